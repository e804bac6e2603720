//! `cargo xtask eval`: a checkpoint's test figures (accuracy, loss and the
//! confusion matrix; a token model's bits per byte; a frame model's MSE).

use std::process::ExitCode;

use anyhow::{bail, Result};
use headroom_pipeline::config::TestTimeAugmentation;

use crate::EvalArgs;

pub fn run(args: EvalArgs) -> Result<ExitCode> {
    let EvalArgs {
        checkpoint,
        data_dir,
        batch,
        tta,
    } = args;
    let tta = tta.as_deref().map(parse_tta).transpose()?;
    let report = headroom_pipeline::eval::evaluate_checkpoint(&checkpoint, data_dir, batch, tta)?;
    print_eval(&report);
    Ok(ExitCode::SUCCESS)
}

fn parse_tta(text: &str) -> Result<TestTimeAugmentation> {
    match text {
        "none" => Ok(TestTimeAugmentation::None),
        "flip" => Ok(TestTimeAugmentation::Flip),
        other => bail!("--tta {other}: expected \"none\" or \"flip\""),
    }
}

fn print_eval(report: &headroom_pipeline::eval::EvalReport) {
    if let Some(bits) = report.bits_per_byte {
        println!(
            "{} (epoch {}, step {}): validation loss {:.4} nats per byte, {bits:.3} bits per byte, \
             token accuracy {:.2}% on {} windows",
            report.checkpoint.display(),
            report.epoch,
            report.step,
            report.loss,
            report.accuracy.unwrap_or(f32::NAN) * 100.0,
            report.samples
        );
        return;
    }
    if let Some(r) = report.regression {
        println!(
            "{} (epoch {}, step {}): test RMSE {:.4}, MAE {:.4}, R² {:.4} (in the targets' units), \
             loss {:.4} (on standardised targets) on {} samples",
            report.checkpoint.display(),
            report.epoch,
            report.step,
            r.rmse,
            r.mae,
            r.r2,
            report.loss,
            report.samples
        );
        return;
    }
    if let Some(m) = report.multilabel {
        println!(
            "{} (epoch {}, step {}): test exact match {:.2}%, per label {:.2}%, macro-F1 {:.4}, \
             micro-F1 {:.4}, loss {:.4} on {} samples",
            report.checkpoint.display(),
            report.epoch,
            report.step,
            m.exact_match * 100.0,
            m.label_accuracy * 100.0,
            m.macro_f1,
            m.micro_f1,
            report.loss,
            report.samples
        );
        return;
    }
    let Some(accuracy) = report.accuracy else {
        // A frame model: a regression, scored against copying the last frame.
        println!(
            "{} (epoch {}, step {}): test loss {:.5} (per-pixel MSE), copy-last-frame baseline {:.5}, on {} sequences",
            report.checkpoint.display(),
            report.epoch,
            report.step,
            report.loss,
            report.baseline_loss.unwrap_or(f32::NAN),
            report.samples
        );
        return;
    };
    println!(
        "{} (epoch {}, step {}): test accuracy {:.2}%, loss {:.4} on {} samples",
        report.checkpoint.display(),
        report.epoch,
        report.step,
        accuracy * 100.0,
        report.loss,
        report.samples
    );
    if let Some(top5) = report.top5_accuracy {
        println!("top-5 accuracy {:.2}%", top5 * 100.0);
    }
    if let Some(f1) = report.macro_f1 {
        println!("macro-F1 {f1:.4} (the mean of each class's F1)");
    }
    println!("confusion matrix (rows: true class, columns: predicted)");
    let classes = report.confusion.len();
    print!("{:>6}", "");
    for k in 0..classes {
        print!("{k:>6}");
    }
    println!();
    for (truth, row) in report.confusion.iter().enumerate() {
        print!("{truth:>6}");
        for count in row {
            print!("{count:>6}");
        }
        println!();
    }
}
