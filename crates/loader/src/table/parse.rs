//! The rows of a CSV table after its header: a tokenizer over the file's
//! bytes and a fast f32 parse, block by block, the blocks split over the
//! cores when they hold no quote.
//!
//! It gives what the `csv` crate's reader (default settings) with
//! `str::parse::<f32>` gave, cell for cell: the same fields (`"` quotes a
//! field, `""` is a quote inside one, text after a closing quote joins the
//! field; `\n`, `\r` and `\r\n` end a record; blank lines are skipped), the
//! same line per record (the line where the reader stood after the record
//! before: a row after blank lines is named by the line after its
//! predecessor, as the `csv` crate's position does), the same f32 bits and
//! the same errors. The tests compare the two readers
//! (`table/reference.rs`).
//!
//! Speed: a cell is parsed by `fast_float2` (correctly rounded, as
//! `str::parse`); a cell it does not read as a finite number (text,
//! `inf`, NaN, Unicode spaces around it) goes to the exact path of before,
//! which names the error. A block without any `"` splits at line ends
//! into one part per core; the parts are read at once and joined in order,
//! each named with its absolute lines, and the first error of the first
//! part that has one is the error (the serial reader's first).

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use super::{format_err, label, label_value, number, TableTarget};
use crate::{LoaderError, Skipped};

/// How the rows are read: [`Tuning::of_machine`], or small blocks in the
/// tests.
#[derive(Clone, Copy, Debug)]
pub(super) struct Tuning {
    /// Bytes read at once; a record longer than a block grows it.
    pub block: usize,
    /// A block shorter than this is read on one core.
    pub parallel_min: usize,
    /// Parts a block splits into at most.
    pub threads: usize,
}

impl Tuning {
    /// 8 MiB blocks, split over the cores this process may use (8 at most)
    /// from 1 MiB.
    pub fn of_machine() -> Self {
        Self {
            block: 8 << 20,
            parallel_min: 1 << 20,
            threads: std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(8),
        }
    }
}

/// The columns read and what they are.
pub(super) struct Columns<'a> {
    pub path: &'a Path,
    /// Cells per row: the header's.
    pub width: usize,
    pub feature_columns: &'a [usize],
    pub feature_names: &'a [String],
    pub target_columns: &'a [usize],
    pub target_names: &'a [String],
    pub target: &'a TableTarget,
}

/// The rows read.
#[derive(Debug, Default)]
pub(super) struct Body {
    pub features: Vec<f32>,
    pub values: Vec<f32>,
    /// Each kept row's line and class (class targets).
    pub class_cells: Vec<(u64, String)>,
    /// Each kept row's line.
    pub lines: Vec<u64>,
    /// The line and class of each row left out.
    pub skipped_classes: Vec<(u64, String)>,
    pub skipped: Vec<Skipped>,
}

impl Body {
    fn append(&mut self, mut other: Body) {
        self.features.append(&mut other.features);
        self.values.append(&mut other.values);
        self.class_cells.append(&mut other.class_cells);
        self.lines.append(&mut other.lines);
        self.skipped_classes.append(&mut other.skipped_classes);
        self.skipped.append(&mut other.skipped);
    }
}

/// The rows of `file` from byte `start` (just after the header) on, the
/// reader standing at `line` there; `skip` leaves out bad rows.
pub(super) fn body(
    mut file: std::fs::File,
    start: u64,
    line: u64,
    columns: &Columns,
    skip: bool,
    tuning: Tuning,
) -> Result<Body, LoaderError> {
    let io = |reason: std::io::Error| LoaderError::Io {
        path: columns.path.to_path_buf(),
        reason,
    };
    file.seek(SeekFrom::Start(start)).map_err(io)?;
    let mut body = Body::default();
    let mut buf = vec![0u8; tuning.block.max(1)];
    let (mut filled, mut line) = (0, line);
    loop {
        let mut eof = false;
        while filled < buf.len() {
            match file.read(&mut buf[filled..]) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io(e)),
            }
        }
        let data = &buf[..filled];
        let (consumed, next_line) = block(columns, data, eof, line, skip, tuning, &mut body)?;
        if eof {
            return Ok(body);
        }
        buf.copy_within(consumed..filled, 0);
        filled -= consumed;
        line = next_line;
        if filled == buf.len() {
            // Not one whole record in a block: a longer block.
            buf.resize(2 * buf.len(), 0);
        }
    }
}

/// Reads the whole records of `data` into `body`, on up to `threads`
/// cores: the bytes read and the line after them.
fn block(
    columns: &Columns,
    data: &[u8],
    eof: bool,
    line: u64,
    skip: bool,
    tuning: Tuning,
    body: &mut Body,
) -> Result<(usize, u64), LoaderError> {
    let starts = match tuning.threads > 1 && data.len() >= tuning.parallel_min {
        // Without a quote every line end ends a record.
        true if memchr::memchr(b'"', data).is_none() => part_starts(data, tuning.threads),
        _ => Vec::new(),
    };
    if starts.is_empty() {
        return rows(columns, data, eof, line, skip, body);
    }
    // Part k: data[bounds[k]..bounds[k + 1]], first line lines[k].
    let mut bounds = vec![0];
    bounds.extend_from_slice(&starts);
    bounds.push(data.len());
    let mut lines = vec![line];
    for k in 1..bounds.len() - 1 {
        let part = &data[bounds[k - 1]..bounds[k]];
        lines.push(lines[k - 1] + memchr::memchr_iter(b'\n', part).count() as u64);
    }
    let parts = bounds.len() - 1;
    let results: Vec<Result<(Body, usize, u64), LoaderError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (1..parts)
            .map(|k| {
                let (part, at) = (&data[bounds[k]..bounds[k + 1]], lines[k]);
                let last = k == parts - 1;
                scope.spawn(move || {
                    let mut part_body = Body::default();
                    rows(columns, part, eof && last, at, skip, &mut part_body)
                        .map(|(used, line)| (part_body, used, line))
                })
            })
            .collect();
        let mut first = Body::default();
        let mut results = vec![
            rows(columns, &data[..bounds[1]], false, line, skip, &mut first)
                .map(|(used, line)| (first, used, line)),
        ];
        results.extend(handles.into_iter().map(|h| match h.join() {
            Ok(result) => result,
            Err(panic) => std::panic::resume_unwind(panic),
        }));
        results
    });
    let mut read = Vec::with_capacity(parts);
    for (k, result) in results.into_iter().enumerate() {
        let (part_body, used, next_line) = result?;
        if k + 1 < parts && bounds[k] + used != bounds[k + 1] {
            // A part that ends inside a record would be a bug in
            // `part_starts`: read the block on one core.
            return rows(columns, data, eof, line, skip, body);
        }
        read.push((part_body, bounds[k] + used, next_line));
    }
    let mut end = (0, line);
    for (part_body, used, next_line) in read {
        body.append(part_body);
        end = (used, next_line);
    }
    Ok(end)
}

/// Where parts 1.. of `data` begin: each just after a line end that
/// ends a record (it follows a cell), where the serial reader stands
/// between two records: the next part's first record is named by the same
/// line as the serial reader names it. Only a `\n` is searched for: a
/// `\r\n` splits after its `\r`.
fn part_starts(data: &[u8], threads: usize) -> Vec<usize> {
    let cell_byte = |k: Option<usize>| k.is_some_and(|k| !matches!(data[k], b'\n' | b'\r'));
    let mut starts: Vec<usize> = Vec::new();
    for k in 1..threads {
        let mut from = (data.len() * k / threads).max(starts.last().copied().unwrap_or(0));
        while let Some(at) = memchr::memchr(b'\n', &data[from..]) {
            let nl = from + at;
            let before = nl.checked_sub(1);
            let start = match before.map(|k| data[k]) {
                Some(b'\r') if cell_byte(nl.checked_sub(2)) => Some(nl),
                _ if cell_byte(before) => Some(nl + 1),
                _ => None,
            };
            match start {
                Some(start)
                    if start < data.len() && starts.last().is_none_or(|&last| start > last) =>
                {
                    starts.push(start);
                    break;
                }
                _ => from = nl + 1,
            }
        }
    }
    starts
}

/// Reads the whole records of `data` into `body`, one core: the bytes read
/// and the line after them. At `eof` the last record may end without a
/// line end; otherwise it is left for the next block.
fn rows(
    columns: &Columns,
    data: &[u8],
    eof: bool,
    line: u64,
    skip: bool,
    body: &mut Body,
) -> Result<(usize, u64), LoaderError> {
    let mut tokens = Tokenizer {
        data,
        eof,
        pos: 0,
        line,
    };
    let mut row = Row::default();
    let mut fused = OnePass::new(columns);
    loop {
        if let Some(fused) = fused.as_mut() {
            if tokens.one_pass_row(fused, body) {
                continue;
            }
        }
        match tokens.next_row(&mut row) {
            Some(line) => columns.take(data, &row, line, skip, body)?,
            None => return Ok((tokens.pos, tokens.line)),
        }
    }
}

/// What a column is, for [`Tokenizer::one_pass_row`].
#[derive(Clone, Copy)]
enum Role {
    /// A number, into `slots[k]`.
    Number(usize),
    /// A 0/1 label, into `slots[k]`.
    Label(usize),
    Class,
    Unread,
}

/// The rows read in one pass: each number parsed where it stands, its end
/// found by the parse.
struct OnePass {
    roles: Vec<Role>,
    /// A row's features, then its numeric targets.
    slots: Vec<f32>,
    features: usize,
}

impl OnePass {
    /// `None` where a column is read twice (the general path reads it).
    fn new(columns: &Columns) -> Option<Self> {
        let mut roles = vec![Role::Unread; columns.width];
        let features = columns.feature_columns.len();
        let mut set = |k: usize, role: Role| match roles.get(k) {
            Some(Role::Unread) => {
                roles[k] = role;
                Some(())
            }
            _ => None,
        };
        for (slot, &k) in columns.feature_columns.iter().enumerate() {
            set(k, Role::Number(slot))?;
        }
        let mut values = 0;
        for &k in columns.target_columns {
            let slot = features + values;
            match columns.target {
                TableTarget::Values => set(k, Role::Number(slot))?,
                TableTarget::Labels => set(k, Role::Label(slot))?,
                TableTarget::Classes { .. } => set(k, Role::Class)?,
                TableTarget::Absent => {}
            }
            values += usize::from(matches!(
                columns.target,
                TableTarget::Values | TableTarget::Labels
            ));
        }
        Some(Self {
            roles,
            slots: vec![0.0; features + values],
            features,
        })
    }
}

/// One record's cells: ranges into the block or, for a record with a
/// quoted field, into `unquoted`.
#[derive(Default)]
struct Row {
    fields: Vec<(usize, usize)>,
    quoted: bool,
    unquoted: Vec<u8>,
}

impl Row {
    fn cell<'a>(&'a self, data: &'a [u8], k: usize) -> &'a [u8] {
        let (start, end) = self.fields[k];
        match self.quoted {
            true => &self.unquoted[start..end],
            false => &data[start..end],
        }
    }
}

struct Tokenizer<'a> {
    data: &'a [u8],
    eof: bool,
    /// Where the next record's scan begins, and the line there.
    pos: usize,
    line: u64,
}

/// A byte that ends an unquoted field.
fn ends_field(b: u8) -> bool {
    matches!(b, b',' | b'\n' | b'\r')
}

impl Tokenizer<'_> {
    /// The next whole record into `row`, and its line; `None` at the end
    /// of the block (a record cut by the block's end is left unread).
    #[inline]
    fn next_row(&mut self, row: &mut Row) -> Option<u64> {
        let data = self.data;
        let (mut p, mut line) = (self.pos, self.line);
        while p < data.len() && matches!(data[p], b'\n' | b'\r') {
            line += u64::from(data[p] == b'\n');
            p += 1;
        }
        if p == data.len() {
            if self.eof {
                (self.pos, self.line) = (p, line);
            }
            return None;
        }
        row.fields.clear();
        row.quoted = false;
        let first = p;
        loop {
            if p < data.len() && data[p] == b'"' {
                return self.quoted_row(row, first, line);
            }
            let start = p;
            while p < data.len() && !ends_field(data[p]) {
                p += 1;
            }
            row.fields.push((start, p));
            if p == data.len() {
                return self.end_at_eof(p, line);
            }
            match data[p] {
                b',' => p += 1,
                _ => return self.end_record(p, line),
            }
        }
    }

    /// The next record into `body` in one pass, where it is plain: no
    /// quote, every number cell a finite number with nothing around it,
    /// every label 0 or 1, the class text, one cell per column, whole in
    /// the block. `false` (nothing read) for any other record, which
    /// [`Tokenizer::next_row`] and [`Columns::take`] read or name.
    #[inline]
    fn one_pass_row(&mut self, fused: &mut OnePass, body: &mut Body) -> bool {
        let data = self.data;
        let (mut p, mut line) = (self.pos, self.line);
        while p < data.len() && matches!(data[p], b'\n' | b'\r') {
            line += u64::from(data[p] == b'\n');
            p += 1;
        }
        let mut class = None;
        let last = fused.roles.len() - 1;
        for (k, &role) in fused.roles.iter().enumerate() {
            if let Role::Number(slot) = role {
                // The parse stops at the cell's end: a `,` or a line end
                // must follow (checked below), so the cell is the number.
                match fast_float2::parse_partial::<f32, _>(&data[p..]) {
                    Ok((value, used)) if value.is_finite() => {
                        fused.slots[slot] = value;
                        p += used;
                    }
                    _ => return false,
                }
            } else {
                if data.get(p) == Some(&b'"') {
                    return false;
                }
                let start = p;
                while p < data.len() && !ends_field(data[p]) {
                    p += 1;
                }
                let cell = &data[start..p];
                match role {
                    Role::Label(slot) => match std::str::from_utf8(cell).ok().and_then(label_value)
                    {
                        Some(value) => fused.slots[slot] = value,
                        None => return false,
                    },
                    Role::Class => match std::str::from_utf8(cell) {
                        Ok(text) => class = Some(text),
                        Err(_) => return false,
                    },
                    _ => {}
                }
            }
            match data.get(p) {
                Some(b',') if k < last => p += 1,
                Some(b'\n' | b'\r') if k == last => {}
                None if k == last && self.eof => {}
                _ => return false,
            }
        }
        let record_line = self.line;
        self.pos = (p + 1).min(data.len());
        self.line = line + u64::from(data.get(p) == Some(&b'\n'));
        body.features
            .extend_from_slice(&fused.slots[..fused.features]);
        body.values
            .extend_from_slice(&fused.slots[fused.features..]);
        body.lines.push(record_line);
        if let Some(class) = class {
            body.class_cells
                .push((record_line, class.trim().to_string()));
        }
        true
    }

    /// The record from `first` on, which has a quoted field, cells
    /// unquoted into `row.unquoted`.
    fn quoted_row(&mut self, row: &mut Row, first: usize, mut line: u64) -> Option<u64> {
        #[derive(PartialEq)]
        enum State {
            Start,
            Plain,
            Quoted,
            QuoteInQuoted,
        }
        let data = self.data;
        row.fields.clear();
        row.quoted = true;
        row.unquoted.clear();
        let (mut state, mut start, mut p) = (State::Start, 0, first);
        while p < data.len() {
            let b = data[p];
            match state {
                State::Quoted => {
                    line += u64::from(b == b'\n');
                    match b {
                        b'"' => state = State::QuoteInQuoted,
                        _ => row.unquoted.push(b),
                    }
                }
                State::QuoteInQuoted if b == b'"' => {
                    row.unquoted.push(b);
                    state = State::Quoted;
                }
                State::Start if b == b'"' => state = State::Quoted,
                _ if b == b',' => {
                    row.fields.push((start, row.unquoted.len()));
                    start = row.unquoted.len();
                    state = State::Start;
                }
                _ if b == b'\n' || b == b'\r' => {
                    row.fields.push((start, row.unquoted.len()));
                    return self.end_record(p, line);
                }
                _ => {
                    row.unquoted.push(b);
                    state = State::Plain;
                }
            }
            p += 1;
        }
        row.fields.push((start, row.unquoted.len()));
        self.end_at_eof(p, line)
    }

    /// The record ends at the line end at `p`: past it. A `\r\n`'s `\n`
    /// is skipped with the next record's leading line ends, as the `csv`
    /// crate does (so a record after a `\r\n` is named by the line of the
    /// `\r`).
    #[inline]
    fn end_record(&mut self, p: usize, line: u64) -> Option<u64> {
        let record_line = self.line;
        let newline = u64::from(self.data[p] == b'\n');
        (self.pos, self.line) = (p + 1, line + newline);
        Some(record_line)
    }

    /// The block ends inside the record: its end at the file's end, else
    /// the record is read with the next block.
    #[inline]
    fn end_at_eof(&mut self, p: usize, line: u64) -> Option<u64> {
        if !self.eof {
            return None;
        }
        let record_line = self.line;
        (self.pos, self.line) = (p, line);
        Some(record_line)
    }
}

impl Columns<'_> {
    /// A record's cells into `body`, or (`skip`) the record into its left
    /// out rows, as the reader before did.
    #[inline]
    fn take(
        &self,
        data: &[u8],
        row: &Row,
        line: u64,
        skip: bool,
        body: &mut Body,
    ) -> Result<(), LoaderError> {
        let path = self.path;
        if row.fields.len() != self.width {
            let error = format_err(
                path,
                format!(
                    "line {line}: {} cells, the header has {} (every row needs one cell per \
                     column)",
                    row.fields.len(),
                    self.width
                ),
            );
            return match skip {
                true => {
                    body.skipped.push(Skipped::row(path, line, error));
                    Ok(())
                }
                false => Err(error),
            };
        }
        let cell = |k: usize, name: &str| text(path, line, name, row.cell(data, k));
        let class_cell = || cell(self.target_columns[0], &self.target_names[0]);
        let class = match self.target {
            TableTarget::Classes { .. } => class_cell().ok().map(|c| c.trim().to_string()),
            _ => None,
        };
        let (features_before, values_before) = (body.features.len(), body.values.len());
        let parsed = (|| -> Result<(), LoaderError> {
            for (&k, name) in self.feature_columns.iter().zip(self.feature_names) {
                body.features
                    .push(cell_number(path, line, name, row.cell(data, k))?);
            }
            match self.target {
                TableTarget::Values => {
                    for (&k, name) in self.target_columns.iter().zip(self.target_names) {
                        body.values
                            .push(cell_number(path, line, name, row.cell(data, k))?);
                    }
                }
                TableTarget::Labels => {
                    for (&k, name) in self.target_columns.iter().zip(self.target_names) {
                        body.values.push(label(path, line, name, cell(k, name)?)?);
                    }
                }
                // A class cell that is not text is named.
                TableTarget::Classes { .. } if class.is_none() => {
                    class_cell()?;
                }
                TableTarget::Classes { .. } | TableTarget::Absent => {}
            }
            Ok(())
        })();
        match (parsed, skip) {
            (Ok(()), _) => {
                body.lines.push(line);
                if let Some(class) = class {
                    body.class_cells.push((line, class));
                }
            }
            (Err(e), true) => {
                body.features.truncate(features_before);
                body.values.truncate(values_before);
                body.skipped.push(Skipped::row(path, line, e));
                if let Some(class) = class {
                    body.skipped_classes.push((line, class));
                }
            }
            (Err(e), false) => return Err(e),
        }
        Ok(())
    }
}

/// A cell as text, or an error naming it.
fn text<'a>(path: &Path, line: u64, column: &str, cell: &'a [u8]) -> Result<&'a str, LoaderError> {
    std::str::from_utf8(cell).map_err(|_| {
        format_err(
            path,
            format!("line {line}, column `{column}`: the cell is not UTF-8 text"),
        )
    })
}

/// A cell as a finite f32 ([`number`]'s value and errors).
#[inline]
pub(super) fn cell_number(
    path: &Path,
    line: u64,
    column: &str,
    cell: &[u8],
) -> Result<f32, LoaderError> {
    match fast_finite(cell) {
        Some(value) => Ok(value),
        None => number(path, line, column, text(path, line, column, cell)?),
    }
}

/// The cell's value where it is a finite number with only ASCII spaces
/// around it: `str::trim` then `str::parse::<f32>`'s value, bit for bit
/// (the tests check `fast_float2` against `str::parse`). `None` for every
/// other cell, which [`number`] reads or names.
#[inline]
pub(super) fn fast_finite(cell: &[u8]) -> Option<f32> {
    // `char::is_whitespace` on ASCII: tab, line feed, vertical tab, form
    // feed, carriage return, space.
    let space = |b: &u8| matches!(b, b'\t'..=b'\r' | b' ');
    let start = cell.iter().position(|b| !space(b))?;
    let end = cell.iter().rposition(|b| !space(b))? + 1;
    match fast_float2::parse::<f32, _>(&cell[start..end]) {
        Ok(value) if value.is_finite() => Some(value),
        _ => None,
    }
}
