//! The run's picture: `plots.svg` in the run directory, drawn from
//! `metrics.jsonl` (so a resumed run's plot covers its whole history), with
//! each task's own figures: the training loss per step (and its moving
//! average) beside the validation (test) loss per epoch; then the test
//! accuracy (classifiers), the per-pixel MSE beside the copy-last-frame
//! baseline's (frame models), or bits per byte (token models); and the
//! throughput. Plain SVG, written by hand: no fonts or system libraries
//! needed. Every curve is a `<polyline>` whose `id` names its series.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::config::ExperimentConfig;
use crate::{PipelineError, Result};

const PANEL_W: f64 = 420.0;
const PANEL_H: f64 = 260.0;
const MARGIN: f64 = 52.0;

/// What a run's model does, which decides its second panel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Task {
    /// Images to classes: accuracy.
    Classifier,
    /// Frames to next frames (`model.frames`): per-pixel MSE and the
    /// copy-last-frame baseline.
    Frames,
    /// Bytes to next bytes (`model.tokens`): bits per byte.
    Tokens,
    /// Features to numeric targets (`train.loss = "mse"` or `"huber"`).
    Regression,
    /// Features to independent 0/1 labels (`train.loss = "bce"`).
    MultiLabel,
}

impl Task {
    pub fn of(config: &ExperimentConfig) -> Self {
        if config.model.frames.is_some() {
            Task::Frames
        } else if config.model.tokens.is_some() {
            Task::Tokens
        } else if config.train.loss.is_regression() {
            Task::Regression
        } else if config.train.loss.is_multilabel() {
            Task::MultiLabel
        } else {
            Task::Classifier
        }
    }
}

/// One curve: its points, colour and the `id` (and legend) naming it.
struct Line {
    id: &'static str,
    label: &'static str,
    color: &'static str,
    points: Vec<(f64, f64)>,
}

impl Line {
    fn new(id: &'static str, label: &'static str, color: &'static str) -> Self {
        Self {
            id,
            label,
            color,
            points: Vec::new(),
        }
    }
}

struct Panel {
    title: &'static str,
    x_label: &'static str,
    /// Epoch axes tick at whole or half epochs, never at 2.75.
    x_in_epochs: bool,
    lines: Vec<Line>,
}

/// What `metrics.jsonl` holds, as curves over epochs (a step at batch `b`
/// of epoch `e` is at `e + (b + 1) / batches_per_epoch`).
#[derive(Default)]
struct Curves {
    step_loss: Vec<(f64, f64)>,
    step_speed: Vec<(f64, f64)>,
    train_loss: Vec<(f64, f64)>,
    test_loss: Vec<(f64, f64)>,
    train_accuracy: Vec<(f64, f64)>,
    test_accuracy: Vec<(f64, f64)>,
    /// The held-out figures are a validation split's, not the test set's.
    validation: bool,
    baseline: Vec<(f64, f64)>,
    epoch_speed: Vec<(f64, f64)>,
}

fn read_curves(text: &str) -> Curves {
    let mut c = Curves::default();
    for line in text.lines() {
        let Ok(value) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let data = &value["data"];
        let number = |key: &str| data[key].as_f64().filter(|v| v.is_finite());
        match value["kind"].as_str() {
            Some("step") => {
                let (Some(epoch), Some(batch), Some(per_epoch)) = (
                    number("epoch"),
                    number("batch"),
                    number("batches_per_epoch").filter(|n| *n > 0.0),
                ) else {
                    continue;
                };
                let x = epoch + (batch + 1.0) / per_epoch;
                if let Some(l) = number("loss") {
                    c.step_loss.push((x, l));
                }
                if let Some(s) = number("samples_per_sec").filter(|s| *s > 0.0) {
                    c.step_speed.push((x, s));
                }
            }
            Some("epoch") => {
                let Some(x) = number("epoch").map(|e| e + 1.0) else {
                    continue;
                };
                let push = |curve: &mut Vec<(f64, f64)>, key: &str, scale: f64| {
                    if let Some(v) = number(key) {
                        curve.push((x, v * scale));
                    }
                };
                push(&mut c.train_loss, "train_loss", 1.0);
                // A run with a validation split scores its epochs on it.
                push(&mut c.test_loss, "test_loss", 1.0);
                push(&mut c.test_loss, "validation_loss", 1.0);
                push(&mut c.train_accuracy, "train_accuracy", 100.0);
                push(&mut c.test_accuracy, "test_accuracy", 100.0);
                push(&mut c.test_accuracy, "validation_accuracy", 100.0);
                c.validation |= number("validation_loss").is_some();
                // A multi-label model's exact-match share stands for accuracy.
                for key in ["test_multilabel", "validation_multilabel"] {
                    if let Some(v) = data[key]["exact_match"].as_f64().filter(|v| v.is_finite()) {
                        c.test_accuracy.push((x, v * 100.0));
                    }
                }
                push(&mut c.baseline, "test_baseline_loss", 1.0);
                push(&mut c.epoch_speed, "train_samples_per_sec", 1.0);
            }
            _ => {}
        }
    }
    c
}

fn panels(curves: Curves, task: Task) -> Vec<Panel> {
    let held_out = if curves.validation {
        "validation"
    } else {
        "test"
    };
    let mut step_loss = Line::new("train-loss-steps", "train (step)", "#c6dbef");
    step_loss.points = curves.step_loss;
    let mut smoothed = Line::new("train-loss", "train (average)", "#08519c");
    smoothed.points = moving_average(&step_loss.points, 25);
    let mut validation = Line::new("validation-loss", "validation", "#d94801");
    validation.points = curves.test_loss.clone();
    let loss = Panel {
        title: match task {
            Task::Classifier => "loss (cross-entropy)",
            Task::Frames => "loss (per-pixel MSE)",
            Task::Tokens => "loss (nats per byte)",
            Task::Regression => "loss (standardised targets)",
            Task::MultiLabel => "loss (binary cross-entropy per label)",
        },
        x_label: "epoch",
        x_in_epochs: true,
        lines: vec![step_loss, smoothed, validation],
    };
    let by_epoch = |title, lines| Panel {
        title,
        x_label: "epoch",
        x_in_epochs: true,
        lines,
    };
    let task_panel = match task {
        Task::MultiLabel => {
            let mut test = Line::new("exact-match", held_out, "#d94801");
            test.points = curves.test_accuracy;
            by_epoch("exact-match accuracy (%)", vec![test])
        }
        Task::Classifier => {
            let mut train = Line::new("train-accuracy", "train", "#6baed6");
            train.points = curves.train_accuracy;
            let mut test = Line::new("test-accuracy", held_out, "#d94801");
            test.points = curves.test_accuracy;
            by_epoch("accuracy (%)", vec![train, test])
        }
        Task::Frames => {
            let mut mse = Line::new("mse", "model", "#d94801");
            mse.points = curves.test_loss;
            let mut baseline = Line::new("baseline", "copy last frame", "#737373");
            baseline.points = curves.baseline;
            by_epoch("test per-pixel MSE", vec![mse, baseline])
        }
        Task::Tokens => {
            let bits = |points: Vec<(f64, f64)>| {
                points
                    .into_iter()
                    .map(|(x, nats)| (x, nats / std::f64::consts::LN_2))
                    .collect()
            };
            let mut train = Line::new("train-bits-per-byte", "train", "#6baed6");
            train.points = bits(curves.train_loss);
            let mut validation = Line::new("validation-bits-per-byte", "validation", "#d94801");
            validation.points = bits(curves.test_loss);
            by_epoch("bits per byte", vec![train, validation])
        }
        Task::Regression => {
            let mut train = Line::new("train-loss-by-epoch", "train", "#6baed6");
            train.points = curves.train_loss;
            let mut test = Line::new("test-loss-by-epoch", held_out, "#d94801");
            test.points = curves.test_loss;
            by_epoch("loss by epoch (standardised targets)", vec![train, test])
        }
    };
    let mut step_speed = Line::new("throughput-steps", "step (average)", "#74c476");
    step_speed.points = moving_average(&curves.step_speed, 25);
    let mut epoch_speed = Line::new("throughput", "epoch", "#00441b");
    epoch_speed.points = curves.epoch_speed;
    let speed = by_epoch("throughput (samples/s)", vec![step_speed, epoch_speed]);
    vec![loss, task_panel, speed]
}

/// Reads `metrics.jsonl` in `dir` and writes `dir/plots.svg` with `task`'s
/// figures.
pub fn write(dir: &Path, task: Task) -> Result<PathBuf> {
    let metrics = dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&metrics).map_err(|e| PipelineError::io(&metrics, e))?;
    let svg = render(
        &panels(read_curves(&text), task),
        &dir.display().to_string(),
    );
    let path = dir.join("plots.svg");
    std::fs::write(&path, svg).map_err(|e| PipelineError::io(&path, e))?;
    Ok(path)
}

fn moving_average(points: &[(f64, f64)], window: usize) -> Vec<(f64, f64)> {
    let mut sum = 0.0;
    points
        .iter()
        .enumerate()
        .map(|(i, &(x, y))| {
            sum += y;
            if i >= window {
                sum -= points[i - window].1;
            }
            (x, sum / (i + 1).min(window) as f64)
        })
        .collect()
}

fn render(panels: &[Panel], caption: &str) -> String {
    let width = PANEL_W * panels.len() as f64;
    let height = PANEL_H + 30.0;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r##"<text x="8" y="{}" fill="#555">{}</text>"##,
        height - 8.0,
        escape(caption)
    );
    for (i, panel) in panels.iter().enumerate() {
        draw_panel(&mut svg, panel, i as f64 * PANEL_W);
    }
    svg.push_str("</svg>\n");
    svg
}

/// Ticks at a "nice" step (1, 2 or 5 × 10^k; for epochs at least a half)
/// covering `[lo, hi]`: the axis runs from the first tick to the last.
struct Ticks {
    step: f64,
    first: f64,
    count: usize,
}

impl Ticks {
    fn new(lo: f64, hi: f64, epochs: bool) -> Self {
        let (lo, hi) = if hi - lo > 1e-12 * hi.abs().max(1.0) {
            (lo, hi)
        } else {
            let pad = (lo.abs() * 0.1).max(if epochs { 0.5 } else { 1e-3 });
            (lo - pad, hi + pad)
        };
        let mut step = nice_step((hi - lo) / 4.0);
        if epochs {
            step = step.max(0.5);
        }
        let first = (lo / step).floor() * step;
        let last = (hi / step).ceil() * step;
        let count = ((last - first) / step).round() as usize + 1;
        Self { step, first, count }
    }

    fn values(&self) -> impl Iterator<Item = f64> + '_ {
        (0..self.count).map(|k| self.first + self.step * k as f64)
    }

    fn range(&self) -> (f64, f64) {
        (
            self.first,
            self.first + self.step * (self.count.max(2) - 1) as f64,
        )
    }

    /// A tick's label: whole numbers as such, others with as many
    /// decimals as the step has.
    fn label(&self, v: f64) -> String {
        let decimals = if (v - v.round()).abs() < self.step * 1e-6 {
            0
        } else {
            (-self.step.log10().floor()).max(0.0) as usize
        };
        let text = format!("{v:.decimals$}");
        // "-0" and "-0.0" read as zero.
        if text
            .trim_start_matches('-')
            .chars()
            .all(|c| c == '0' || c == '.')
        {
            text.trim_start_matches('-').to_string()
        } else {
            text
        }
    }
}

/// The smallest 1, 2 or 5 × 10^k at or above `raw`.
fn nice_step(raw: f64) -> f64 {
    if !(raw.is_finite() && raw > 0.0) {
        return 1.0;
    }
    let magnitude = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|&s| s >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * magnitude)
}

fn draw_panel(svg: &mut String, panel: &Panel, left: f64) {
    let points = panel.lines.iter().flat_map(|l| l.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in points {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    let (plot_l, plot_r) = (left + MARGIN, left + PANEL_W - 16.0);
    let (plot_t, plot_b) = (28.0, PANEL_H - 28.0);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="16" font-size="13" font-weight="bold">{}</text>"#,
        plot_l, panel.title
    );
    let _ = writeln!(
        svg,
        r##"<rect x="{plot_l}" y="{plot_t}" width="{}" height="{}" fill="none" stroke="#999"/>"##,
        plot_r - plot_l,
        plot_b - plot_t
    );
    if x0 > x1 {
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{}">no data yet</text>"#,
            plot_l + 10.0,
            plot_t + 20.0
        );
        return;
    }
    // Epoch axes start at the run's start.
    let x_lo = if panel.x_in_epochs { x0.min(0.0) } else { x0 };
    let x_ticks = Ticks::new(x_lo, x1, panel.x_in_epochs);
    let y_ticks = Ticks::new(y0, y1, false);
    let ((x0, x1), (y0, y1)) = (x_ticks.range(), y_ticks.range());
    let sx = |x: f64| plot_l + (x - x0) / (x1 - x0) * (plot_r - plot_l);
    let sy = |y: f64| plot_b - (y - y0) / (y1 - y0) * (plot_b - plot_t);
    for y in y_ticks.values() {
        let _ = writeln!(
            svg,
            r##"<line x1="{plot_l}" x2="{plot_r}" y1="{py:.1}" y2="{py:.1}" stroke="#eee"/><text class="tick y" x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            plot_l - 4.0,
            sy(y) + 4.0,
            y_ticks.label(y),
            py = sy(y)
        );
    }
    for x in x_ticks.values() {
        let _ = writeln!(
            svg,
            r#"<text class="tick x" x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
            sx(x),
            plot_b + 14.0,
            x_ticks.label(x)
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
        (plot_l + plot_r) / 2.0,
        plot_b + 26.0,
        panel.x_label
    );
    let mut legend_y = plot_t + 12.0;
    for line in panel.lines.iter().filter(|l| !l.points.is_empty()) {
        let path: Vec<String> = line
            .points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline id="{}" fill="none" stroke="{}" stroke-width="1.5" points="{}"><title>{}</title></polyline>"#,
            line.id,
            line.color,
            path.join(" "),
            line.label
        );
        if line.points.len() <= 50 {
            for &(x, y) in &line.points {
                let _ = writeln!(
                    svg,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{}"/>"#,
                    sx(x),
                    sy(y),
                    line.color
                );
            }
        }
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{legend_y:.1}" text-anchor="end" fill="{}">{}</text>"#,
            plot_r - 6.0,
            line.color,
            line.label
        );
        legend_y += 13.0;
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round() {
        let t = Ticks::new(0.0, 2.75, true);
        assert_eq!(t.step, 1.0);
        let labels: Vec<String> = t.values().map(|v| t.label(v)).collect();
        assert_eq!(labels, ["0", "1", "2", "3"]);
        let t = Ticks::new(0.0, 1.5, true);
        let labels: Vec<String> = t.values().map(|v| t.label(v)).collect();
        assert_eq!(labels, ["0", "0.5", "1", "1.5"]);
        let t = Ticks::new(0.1234, 1.91, false);
        assert_eq!(t.step, 0.5);
        let t = Ticks::new(87.3, 91.9, false);
        assert_eq!((t.step, t.first), (2.0, 86.0));
        assert_eq!(t.label(88.0), "88");
        let t = Ticks::new(0.0031, 0.0042, false);
        assert_eq!(t.label(0.0035), "0.0035");
        assert_eq!(nice_step(0.3), 0.5);
        assert_eq!(nice_step(3000.0), 5000.0);
        assert_eq!(nice_step(1.0), 1.0);
        let flat = Ticks::new(2.0, 2.0, false);
        assert!(flat.range().0 < 2.0 && flat.range().1 > 2.0);
    }
}
