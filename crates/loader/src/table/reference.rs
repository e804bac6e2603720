//! The reader that [`super::parse`] replaced, kept for the tests to
//! compare with: the `csv` crate's records, each cell `str::trim`med and
//! read by `str::parse::<f32>`.

use super::parse::{Body, Columns};
use super::{csv_error, format_err, label, number, TableTarget};
use crate::{LoaderError, Skipped};

/// The rows after the header, as `CsvTable::open` read them before.
pub(super) fn body(
    mut reader: csv::Reader<std::fs::File>,
    columns: &Columns,
    skip: bool,
) -> Result<Body, LoaderError> {
    let path = columns.path;
    let mut skipped: Option<Vec<Skipped>> = skip.then(Vec::new);
    let mut features = Vec::new();
    let mut values = Vec::new();
    let mut class_cells: Vec<(u64, String)> = Vec::new();
    let mut lines = Vec::new();
    // The classes of the rows left out, to check none is emptied.
    let mut skipped_classes: Vec<(u64, String)> = Vec::new();
    // One record reused for every row, checked as UTF-8 once a row
    // (a cell at a time only to name a bad one): no allocation per row.
    let mut record = csv::ByteRecord::new();
    loop {
        match reader.read_byte_record(&mut record) {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => {
                let line = e.position().map_or(0, |p| p.line());
                match skipped.as_mut() {
                    Some(skipped) => {
                        skipped.push(Skipped::row(path, line, csv_error(path, e)));
                        continue;
                    }
                    None => return Err(csv_error(path, e)),
                }
            }
        }
        let line = record.position().map_or(0, |p| p.line());
        let row = std::str::from_utf8(record.as_slice()).ok();
        let cell = |k: usize, name: &str| {
            // The row is the cells' bytes end to end: a cell whose
            // bounds are char boundaries of a valid row is valid text;
            // any other is checked alone, to name it if it is not.
            let valid = row.zip(record.range(k)).and_then(|(row, at)| row.get(at));
            match valid {
                Some(text) => Ok(text),
                None => std::str::from_utf8(&record[k]).map_err(|_| {
                    format_err(
                        path,
                        format!("line {line}, column `{name}`: the cell is not UTF-8 text"),
                    )
                }),
            }
        };
        let class_cell = || cell(columns.target_columns[0], &columns.target_names[0]);
        let class = match columns.target {
            TableTarget::Classes { .. } => class_cell().ok().map(|c| c.trim().to_string()),
            _ => None,
        };
        let (features_before, values_before) = (features.len(), values.len());
        let parsed = (|| -> Result<(), LoaderError> {
            for (&k, name) in columns.feature_columns.iter().zip(columns.feature_names) {
                features.push(number(path, line, name, cell(k, name)?)?);
            }
            match columns.target {
                TableTarget::Values => {
                    for (&k, name) in columns.target_columns.iter().zip(columns.target_names) {
                        values.push(number(path, line, name, cell(k, name)?)?);
                    }
                }
                TableTarget::Labels => {
                    for (&k, name) in columns.target_columns.iter().zip(columns.target_names) {
                        values.push(label(path, line, name, cell(k, name)?)?);
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
        match (parsed, skipped.as_mut()) {
            (Ok(()), _) => {
                lines.push(line);
                if let Some(class) = class {
                    class_cells.push((line, class));
                }
            }
            (Err(e), Some(skipped)) => {
                features.truncate(features_before);
                values.truncate(values_before);
                skipped.push(Skipped::row(path, line, e));
                if let Some(class) = class {
                    skipped_classes.push((line, class));
                }
            }
            (Err(e), None) => return Err(e),
        }
    }
    Ok(Body {
        features,
        values,
        class_cells,
        lines,
        skipped_classes,
        skipped: skipped.unwrap_or_default(),
    })
}
