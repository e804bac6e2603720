//! A CSV table as a dataset: numeric feature columns in, one class column
//! or numeric target columns out.
//!
//! Design: the file is parsed once, whole, into f32 columns (data that
//! fits in memory; `preprocess` packs a larger table into the shard
//! store). Each row is a sample of shape `[1, features, 1]` with f32
//! elements ([`Element::F32`]); a classification table's label is its
//! class id, a regression table's targets follow the features in the
//! record ([`SampleKind`]). Features and numeric targets are standardised
//! with the training table's statistics ([`TableScale`], recorded with the
//! run), so the test table and later predictions use the same numbers.
//!
//! Memory: 4 bytes per cell kept (features and targets), plus the class
//! names.
//!
//! Every bad cell is an error naming the file, the line and the column:
//! a header that is missing or repeats a name, a ragged row, a cell that
//! is not a number, NaN or infinity, a class the training table does not
//! have.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::{Dataset, Element, LoaderError, SampleKind, Skipped};

mod parse;
#[cfg(test)]
mod reference;
#[cfg(test)]
mod tests;

/// Reads a table's rows after its header (the reader stands just after
/// it): [`parse::body`], or in the tests the reader it replaced.
type BodyReader =
    fn(csv::Reader<std::fs::File>, &parse::Columns, bool) -> Result<parse::Body, LoaderError>;

/// What the target columns hold.
#[derive(Clone, Debug, PartialEq)]
pub enum TableTarget {
    /// One column of class names or ids. `classes` fixes the names and
    /// their order (a test table takes its training table's); `None` finds
    /// them in the file: non-negative integers are their own ids
    /// (`0..=max`), any other names are sorted.
    Classes { classes: Option<Vec<String>> },
    /// One or more numeric columns (regression).
    Values,
    /// One or more 0/1 columns, each an independent label (multi-label
    /// classification): kept as they are, never standardised.
    Labels,
    /// None: rows to score. The target columns named are left out of the
    /// features where the file has them, and need not be there.
    Absent,
}

/// Which columns are what.
#[derive(Clone, Debug, PartialEq)]
pub struct TableConfig {
    /// Target column names (one for classes, one or more for values).
    pub targets: Vec<String>,
    /// Feature column names, in the order the model takes them. Empty:
    /// every column that is not a target, in file order.
    pub features: Vec<String>,
    pub target: TableTarget,
}

/// Per-column `(mean, std)` of the features and numeric targets, from the
/// training table: a value is stored as `(x - mean) / std`.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TableScale {
    pub features: Vec<(f32, f32)>,
    pub values: Vec<(f32, f32)>,
}

/// A CSV file read whole: see the module docs.
#[derive(Clone, Debug)]
pub struct CsvTable {
    path: PathBuf,
    feature_names: Vec<String>,
    target_names: Vec<String>,
    /// `rows * features`, row-major.
    features: Vec<f32>,
    /// `rows * targets` for values; empty for classes.
    values: Vec<f32>,
    /// One per row for classes; empty for values.
    labels: Vec<u32>,
    /// Each row's line in the file.
    lines: Vec<u64>,
    classes: Vec<String>,
    scale: Option<TableScale>,
    /// The targets are 0/1 labels: their scale is the identity.
    labels_target: bool,
}

fn format_err(path: &Path, message: String) -> LoaderError {
    LoaderError::Format {
        path: path.to_path_buf(),
        message,
    }
}

/// [`parse::body`] from where the `csv` reader stands after the header.
fn fast_body(
    reader: csv::Reader<std::fs::File>,
    columns: &parse::Columns,
    skip: bool,
) -> Result<parse::Body, LoaderError> {
    tuned_body(reader, columns, skip, parse::Tuning::of_machine())
}

fn tuned_body(
    reader: csv::Reader<std::fs::File>,
    columns: &parse::Columns,
    skip: bool,
    tuning: parse::Tuning,
) -> Result<parse::Body, LoaderError> {
    let position = reader.position().clone();
    parse::body(
        reader.into_inner(),
        position.byte(),
        position.line(),
        columns,
        skip,
        tuning,
    )
}

/// A `csv` reader's error: a ragged row's names its line.
fn csv_error(path: &Path, e: csv::Error) -> LoaderError {
    match e.kind() {
        csv::ErrorKind::UnequalLengths {
            pos,
            expected_len,
            len,
        } => format_err(
            path,
            format!(
                "line {}: {len} cells, the header has {expected_len} (every row needs one \
                 cell per column)",
                pos.as_ref().map_or(0, |p| p.line())
            ),
        ),
        _ => format_err(path, e.to_string()),
    }
}

/// A cell as a finite f32, or an error naming where it is.
fn number(path: &Path, line: u64, column: &str, cell: &str) -> Result<f32, LoaderError> {
    let trimmed = cell.trim();
    let value: f32 = trimmed.parse().map_err(|_| {
        format_err(
            path,
            format!("line {line}, column `{column}`: {cell:?} is not a number"),
        )
    })?;
    if !value.is_finite() {
        return Err(format_err(
            path,
            format!(
                "line {line}, column `{column}`: {trimmed} is not finite (features and targets \
                 must be finite numbers: remove or fill the row)"
            ),
        ));
    }
    Ok(value)
}

/// A multi-label target cell: 0 or 1 (also `true`/`false`).
fn label(path: &Path, line: u64, column: &str, cell: &str) -> Result<f32, LoaderError> {
    label_value(cell).ok_or_else(|| {
        format_err(
            path,
            format!(
                "line {line}, column `{column}`: {:?} is not a label (train.loss = \"bce\" \
                 reads each target column as 0 or 1)",
                cell.trim()
            ),
        )
    })
}

/// [`label`]'s value, `None` where it is an error.
fn label_value(cell: &str) -> Option<f32> {
    match cell.trim() {
        "1" | "1.0" | "true" | "True" | "TRUE" => Some(1.0),
        "0" | "0.0" | "false" | "False" | "FALSE" => Some(0.0),
        _ => None,
    }
}

impl CsvTable {
    /// Reads `path` (a header row naming the columns, then one row per
    /// sample) as `config` says.
    pub fn open(path: &Path, config: &TableConfig) -> Result<Self, LoaderError> {
        Self::read(path, config, None)
    }

    /// [`CsvTable::open`], leaving out each row that cannot be read (a
    /// ragged row, a cell that is not a number, NaN or infinity, a label
    /// that is not 0 or 1) and saying which and why (`data.bad_samples =
    /// "skip"`). A class whose every row was left out is an error: skipping
    /// never empties a class. Everything else (a missing column, no rows)
    /// is the same error as `open`'s.
    pub fn open_skipping(
        path: &Path,
        config: &TableConfig,
    ) -> Result<(Self, Vec<Skipped>), LoaderError> {
        let mut skipped = Vec::new();
        let table = Self::read(path, config, Some(&mut skipped))?;
        Ok((table, skipped))
    }

    fn read(
        path: &Path,
        config: &TableConfig,
        skipped: Option<&mut Vec<Skipped>>,
    ) -> Result<Self, LoaderError> {
        Self::read_with(path, config, skipped, fast_body)
    }

    fn read_with(
        path: &Path,
        config: &TableConfig,
        skipped: Option<&mut Vec<Skipped>>,
        read_body: BodyReader,
    ) -> Result<Self, LoaderError> {
        let io = |reason: std::io::Error| LoaderError::Io {
            path: path.to_path_buf(),
            reason,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let mut reader = csv::ReaderBuilder::new()
            .has_headers(true)
            .from_reader(file);
        let csv_err = |e: csv::Error| csv_error(path, e);
        let header: Vec<String> = reader
            .headers()
            .map_err(csv_err)?
            .iter()
            .map(|h| h.trim().to_string())
            .collect();
        check_header(path, &header)?;
        let position = |name: &str| {
            header.iter().position(|h| h == name).ok_or_else(|| {
                format_err(
                    path,
                    format!(
                        "has no column `{name}` (its columns: {})",
                        header.join(", ")
                    ),
                )
            })
        };
        let absent = config.target == TableTarget::Absent;
        if config.targets.is_empty() && !absent {
            return Err(format_err(path, "no target column named".into()));
        }
        if matches!(config.target, TableTarget::Classes { .. }) && config.targets.len() != 1 {
            return Err(format_err(
                path,
                format!(
                    "a class target is one column, {} were named",
                    config.targets.len()
                ),
            ));
        }
        let target_columns = match absent {
            true => Vec::new(),
            false => config
                .targets
                .iter()
                .map(|t| position(t))
                .collect::<Result<Vec<_>, _>>()?,
        };
        let feature_names: Vec<String> = if config.features.is_empty() {
            header
                .iter()
                .filter(|h| !config.targets.contains(h))
                .cloned()
                .collect()
        } else {
            config.features.clone()
        };
        if let Some(both) = feature_names.iter().find(|f| config.targets.contains(f)) {
            return Err(format_err(
                path,
                format!("column `{both}` is named both as a feature and as a target"),
            ));
        }
        if feature_names.is_empty() {
            return Err(format_err(
                path,
                "has no feature column besides the targets".into(),
            ));
        }
        let feature_columns = feature_names
            .iter()
            .map(|f| position(f))
            .collect::<Result<Vec<_>, _>>()?;
        let columns = parse::Columns {
            path,
            width: header.len(),
            feature_columns: &feature_columns,
            feature_names: &feature_names,
            target_columns: &target_columns,
            target_names: &config.targets,
            target: &config.target,
        };
        let parse::Body {
            features,
            values,
            class_cells,
            lines,
            skipped_classes,
            skipped: skipped_rows,
        } = read_body(reader, &columns, skipped.is_some())?;
        if let Some(skipped) = skipped {
            skipped.extend(skipped_rows);
        }
        if let Some((line, class)) = skipped_classes
            .iter()
            .find(|(_, class)| !class_cells.iter().any(|(_, kept)| kept == class))
        {
            return Err(format_err(
                path,
                format!(
                    "every row of class `{class}` was left out as unreadable (the first at line \
                     {line}): skipping would empty the class; fix the rows or remove the class"
                ),
            ));
        }
        let rows = features.len() / feature_names.len();
        if rows == 0 {
            return Err(format_err(path, "has a header but no rows".into()));
        }
        let (labels, classes) = match &config.target {
            TableTarget::Values | TableTarget::Labels | TableTarget::Absent => {
                (Vec::new(), Vec::new())
            }
            TableTarget::Classes { classes } => {
                class_ids(path, &config.targets[0], &class_cells, classes.as_deref())?
            }
        };
        Ok(Self {
            path: path.to_path_buf(),
            feature_names,
            target_names: config.targets.clone(),
            features,
            values,
            labels,
            lines,
            classes,
            scale: None,
            labels_target: config.target == TableTarget::Labels,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn rows(&self) -> usize {
        self.features.len() / self.feature_names.len().max(1)
    }

    /// The line in the file of each row, in order.
    pub fn lines(&self) -> &[u64] {
        &self.lines
    }

    pub fn feature_names(&self) -> &[String] {
        &self.feature_names
    }

    pub fn target_names(&self) -> &[String] {
        &self.target_names
    }

    /// The class names, by id (empty for a regression table).
    pub fn classes(&self) -> &[String] {
        &self.classes
    }

    /// The mean and standard deviation of each feature and numeric target
    /// (a constant column gets std 1, so it is only centred).
    pub fn scale(&self) -> TableScale {
        let stats = |data: &[f32], width: usize| -> Vec<(f32, f32)> {
            let rows = self.rows().max(1) as f64;
            (0..width)
                .map(|k| {
                    let column = data.iter().skip(k).step_by(width).map(|&v| f64::from(v));
                    let mean = column.clone().sum::<f64>() / rows;
                    let var = column.map(|v| (v - mean) * (v - mean)).sum::<f64>() / rows;
                    let std = var.sqrt();
                    let std = if std > 1e-12 { std } else { 1.0 };
                    (mean as f32, std as f32)
                })
                .collect()
        };
        TableScale {
            features: stats(&self.features, self.feature_names.len()),
            values: if self.labels_target {
                vec![(0.0, 1.0); self.values_per_row()]
            } else {
                stats(&self.values, self.values_per_row())
            },
        }
    }

    /// Stores every feature and numeric target as `(x - mean) / std` with
    /// `scale` (the training table's), once.
    pub fn standardize(&mut self, scale: &TableScale) -> Result<(), LoaderError> {
        let (features, values) = (self.feature_names.len(), self.values_per_row());
        if scale.features.len() != features || scale.values.len() != values {
            return Err(format_err(
                &self.path,
                format!(
                    "the scale holds {} features and {} targets, the table {features} and \
                     {values}",
                    scale.features.len(),
                    scale.values.len()
                ),
            ));
        }
        if self.scale.is_some() {
            return Err(format_err(&self.path, "standardised twice".into()));
        }
        let apply = |data: &mut [f32], stats: &[(f32, f32)]| {
            for row in data.chunks_exact_mut(stats.len().max(1)) {
                for (x, &(mean, std)) in row.iter_mut().zip(stats) {
                    *x = (*x - mean) / std;
                }
            }
        };
        apply(&mut self.features, &scale.features);
        apply(&mut self.values, &scale.values);
        self.scale = Some(scale.clone());
        Ok(())
    }

    fn values_per_row(&self) -> usize {
        if self.values.is_empty() {
            0
        } else {
            self.target_names.len()
        }
    }
}

/// A header names every column once, and is not a row of numbers (a file
/// without a header would lose its first sample to it).
fn check_header(path: &Path, header: &[String]) -> Result<(), LoaderError> {
    if header.is_empty() || header.iter().all(|h| h.is_empty()) {
        return Err(format_err(
            path,
            "is empty: expected a header row naming the columns".into(),
        ));
    }
    if header.iter().all(|h| h.parse::<f64>().is_ok()) {
        return Err(format_err(
            path,
            format!(
                "its first row ({}) is all numbers: the first row must be a header naming the \
                 columns",
                header.join(",")
            ),
        ));
    }
    let mut seen = BTreeSet::new();
    for name in header {
        if name.is_empty() {
            return Err(format_err(
                path,
                "the header has an empty column name".into(),
            ));
        }
        if !seen.insert(name) {
            return Err(format_err(
                path,
                format!("the header names column `{name}` twice"),
            ));
        }
    }
    Ok(())
}

/// Each row's class id, and the class names by id.
fn class_ids(
    path: &Path,
    column: &str,
    cells: &[(u64, String)],
    known: Option<&[String]>,
) -> Result<(Vec<u32>, Vec<String>), LoaderError> {
    let classes: Vec<String> = match known {
        Some(names) => names.to_vec(),
        None => {
            if let Some((line, _)) = cells.iter().find(|(_, c)| c.is_empty()) {
                return Err(format_err(
                    path,
                    format!("line {line}, column `{column}`: the class is empty"),
                ));
            }
            let ids: Option<Vec<u32>> = cells.iter().map(|(_, c)| c.parse().ok()).collect();
            match ids.as_ref().and_then(|ids| ids.iter().max()) {
                Some(&max) if max < 1 << 16 => (0..=max).map(|k| k.to_string()).collect(),
                _ => cells
                    .iter()
                    .map(|(_, c)| c.clone())
                    .collect::<BTreeSet<_>>()
                    .into_iter()
                    .collect(),
            }
        }
    };
    let labels = cells
        .iter()
        .map(|(line, cell)| {
            classes
                .iter()
                .position(|c| c == cell)
                .map(|k| k as u32)
                .ok_or_else(|| {
                    format_err(
                        path,
                        format!(
                            "line {line}, column `{column}`: class {cell:?} is not one of the \
                             training table's classes ({})",
                            classes.join(", ")
                        ),
                    )
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if classes.len() < 2 && known.is_none() {
        return Err(format_err(
            path,
            format!("column `{column}` holds a single class: a classifier needs two or more"),
        ));
    }
    Ok((labels, classes))
}

impl Dataset for CsvTable {
    fn len(&self) -> usize {
        self.rows()
    }

    fn sample_shape(&self) -> [usize; 3] {
        [1, self.feature_names.len(), 1]
    }

    fn num_classes(&self) -> usize {
        self.classes.len().max(1)
    }

    fn sample_kind(&self) -> SampleKind {
        let values = self.values_per_row();
        SampleKind {
            element: Element::F32,
            values,
            value_scale: self
                .scale
                .as_ref()
                .map_or_else(Vec::new, |s| s.values.clone()),
        }
    }

    fn read(&self, index: usize, out: &mut [u8]) -> Result<u32, LoaderError> {
        let rows = self.rows();
        if index >= rows {
            return Err(LoaderError::Index { index, len: rows });
        }
        let (f, v) = (self.feature_names.len(), self.values_per_row());
        let expected = 4 * (f + v);
        if out.len() != expected {
            return Err(LoaderError::Buffer {
                index,
                actual: out.len(),
                expected,
            });
        }
        let cells = self.features[index * f..(index + 1) * f]
            .iter()
            .chain(&self.values[index * v..(index + 1) * v]);
        for (slot, value) in out.chunks_exact_mut(4).zip(cells) {
            slot.copy_from_slice(&value.to_le_bytes());
        }
        Ok(self.labels.get(index).copied().unwrap_or(0))
    }

    fn fingerprint(&self) -> Option<u32> {
        let mut hasher = crc32fast::Hasher::new();
        for name in self.feature_names.iter().chain(&self.target_names) {
            hasher.update(name.as_bytes());
            hasher.update(&[0]);
        }
        for value in self.features.iter().chain(&self.values) {
            hasher.update(&value.to_le_bytes());
        }
        for label in &self.labels {
            hasher.update(&label.to_le_bytes());
        }
        Some(hasher.finalize())
    }

    fn memory_limit(&self) -> u64 {
        4 * (self.features.len() + self.values.len() + self.labels.len()) as u64
    }
}
