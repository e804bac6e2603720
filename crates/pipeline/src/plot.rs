//! The run's picture: `plots.svg` in the run directory, drawn from
//! `metrics.jsonl` (so a resumed run's plot covers its whole history): the
//! training loss per step (and its moving average), the test accuracy per
//! epoch, and the throughput. Plain SVG, written by hand: no fonts or
//! system libraries needed.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::{PipelineError, Result};

const PANEL_W: f64 = 420.0;
const PANEL_H: f64 = 260.0;
const MARGIN: f64 = 48.0;

struct Series {
    title: &'static str,
    x_label: &'static str,
    lines: Vec<(Vec<(f64, f64)>, &'static str)>,
}

/// Reads `metrics.jsonl` in `dir` and writes `dir/plots.svg`.
pub fn write(dir: &Path) -> Result<PathBuf> {
    let metrics = dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&metrics).map_err(|e| PipelineError::io(&metrics, e))?;
    let (mut loss, mut speed, mut accuracy) = (Vec::new(), Vec::new(), Vec::new());
    let mut epoch_speed = Vec::new();
    let mut last_step = 0.0;
    for line in text.lines() {
        let Ok(value) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let data = &value["data"];
        match value["kind"].as_str() {
            Some("step") => {
                let step = data["step"].as_f64().unwrap_or(last_step);
                last_step = step;
                if let Some(l) = data["loss"].as_f64().filter(|l| l.is_finite()) {
                    loss.push((step, l));
                }
                if let Some(s) = data["samples_per_sec"].as_f64().filter(|s| *s > 0.0) {
                    speed.push((step, s));
                }
            }
            Some("epoch") => {
                let epoch = data["epoch"].as_f64().unwrap_or(0.0) + 1.0;
                if let Some(a) = data["test_accuracy"].as_f64() {
                    accuracy.push((epoch, 100.0 * a));
                }
                if let Some(s) = data["train_samples_per_sec"].as_f64() {
                    epoch_speed.push((last_step, s));
                }
            }
            _ => {}
        }
    }
    let smoothed = moving_average(&loss, 25);
    let speed = moving_average(&speed, 25);
    let panels = [
        Series {
            title: "training loss",
            x_label: "step",
            lines: vec![(loss, "#9ecae1"), (smoothed, "#08519c")],
        },
        Series {
            title: "test accuracy (%)",
            x_label: "epoch",
            lines: vec![(accuracy, "#d94801")],
        },
        Series {
            title: "throughput (samples/s)",
            x_label: "step",
            lines: vec![(speed, "#74c476"), (epoch_speed, "#00441b")],
        },
    ];
    let svg = render(&panels, &dir.display().to_string());
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

fn render(panels: &[Series], caption: &str) -> String {
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

fn draw_panel(svg: &mut String, panel: &Series, left: f64) {
    let points = panel.lines.iter().flat_map(|(p, _)| p.iter());
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
    if x1 - x0 < 1e-9 {
        (x0, x1) = (x0 - 1.0, x1 + 1.0);
    }
    if y1 - y0 < 1e-9 {
        (y0, y1) = (y0 - 1.0, y1 + 1.0);
    }
    let sx = |x: f64| plot_l + (x - x0) / (x1 - x0) * (plot_r - plot_l);
    let sy = |y: f64| plot_b - (y - y0) / (y1 - y0) * (plot_b - plot_t);
    for k in 0..=4 {
        let y = y0 + (y1 - y0) * k as f64 / 4.0;
        let _ = writeln!(
            svg,
            r##"<line x1="{plot_l}" x2="{plot_r}" y1="{py:.1}" y2="{py:.1}" stroke="#eee"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            plot_l - 4.0,
            sy(y) + 4.0,
            tick(y),
            py = sy(y)
        );
        let x = x0 + (x1 - x0) * k as f64 / 4.0;
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
            sx(x),
            plot_b + 14.0,
            tick(x)
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
        (plot_l + plot_r) / 2.0,
        plot_b + 26.0,
        panel.x_label
    );
    for (line, color) in &panel.lines {
        let path: Vec<String> = line
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"/>"#,
            path.join(" ")
        );
        if line.len() <= 50 {
            for &(x, y) in line {
                let _ = writeln!(
                    svg,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{color}"/>"#,
                    sx(x),
                    sy(y)
                );
            }
        }
    }
}

fn tick(v: f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        return format!("{v:.0}");
    }
    match v.abs() {
        a if a >= 100.0 => format!("{v:.0}"),
        a if a >= 10.0 => format!("{v:.1}"),
        _ => format!("{v:.3}"),
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
    fn plot_has_a_line_per_series_and_survives_empty_metrics() {
        let dir = tempfile::tempdir().unwrap();
        let mut lines = String::new();
        for step in 1..=40 {
            lines += &format!(
                "{{\"kind\":\"step\",\"data\":{{\"step\":{step},\"loss\":{},\"samples_per_sec\":100.0}}}}\n",
                2.3 / step as f64
            );
        }
        lines += "{\"kind\":\"epoch\",\"data\":{\"epoch\":0,\"test_accuracy\":0.8,\"train_samples_per_sec\":120.0}}\n";
        std::fs::write(dir.path().join("metrics.jsonl"), lines).unwrap();
        let svg = std::fs::read_to_string(write(dir.path()).unwrap()).unwrap();
        assert_eq!(svg.matches("<polyline").count(), 5);
        assert!(svg.contains("training loss") && svg.contains("test accuracy"));

        std::fs::write(dir.path().join("metrics.jsonl"), "").unwrap();
        let svg = std::fs::read_to_string(write(dir.path()).unwrap()).unwrap();
        assert!(svg.contains("no data yet"));
    }
}
