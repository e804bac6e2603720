//! Frame prediction on Moving-Fashion-MNIST: the `[frames]` sequences made
//! on the fly from the Fashion-MNIST images (found or installed as the
//! image experiments find them; train images for training, test images for
//! testing), and the check that they fit the frame model (`model.frames`).
//! A sample is `model.frames + 1` frames stacked along the height; the model
//! reads the first `model.frames` and is scored on each one's successor.

use std::sync::Arc;

use headroom_loader::{Dataset, IdxDataset, MovingConfig, MovingFashionMnist, Split};

use crate::config::{ExperimentConfig, FramesConfig};
use crate::{PipelineError, Result};

/// Keys of the two splits' sequences, so that they differ for one seed.
const TRAIN_KEY: u64 = 0;
const TEST_KEY: u64 = 1;

fn frames_config(config: &ExperimentConfig) -> Result<&FramesConfig> {
    config.frames.as_ref().ok_or_else(|| {
        PipelineError::value(
            "frames",
            "data.format = \"moving_fashion_mnist\" needs a [frames] table",
        )
    })
}

fn model_frames(config: &ExperimentConfig) -> Result<usize> {
    config.model.frames.ok_or_else(|| {
        PipelineError::value(
            "model.frames",
            "frame data needs a frame model: set model.frames to the frames it reads",
        )
    })
}

/// The training and test sequences.
pub fn open_splits(
    config: &ExperimentConfig,
    allow_install: bool,
) -> Result<(Arc<dyn Dataset>, Arc<dyn Dataset>)> {
    let settings = frames_config(config)?;
    let frames = model_frames(config)? + 1;
    let dir = crate::sources::locate_fashion_mnist(config.data.dir.as_deref(), allow_install)?;
    tracing::info!("Moving-Fashion-MNIST garments from {}", dir.display());
    // Each split opened by itself: there is no "splits missing" to report,
    // only the error of the split that could not be opened.
    let open = |split: Split, tag: u64| -> Result<Arc<dyn Dataset>> {
        let sequences = match split {
            Split::Train => settings.train_sequences,
            Split::Test => settings.test_sequences,
        };
        let source = Arc::new(IdxDataset::fashion_mnist(&dir, split)?);
        let moving = MovingFashionMnist::new(
            source,
            MovingConfig {
                frames,
                size: settings.size,
                garments: settings.garments,
                sequences,
                seed: settings.seed.wrapping_mul(2).wrapping_add(tag),
            },
        )?;
        tracing::info!(
            "{split}: {sequences} sequences of {frames} frames of {0}x{0}, {1} garments each",
            settings.size,
            settings.garments
        );
        Ok(Arc::new(moving) as Arc<dyn Dataset>)
    };
    Ok((open(Split::Train, TRAIN_KEY)?, open(Split::Test, TEST_KEY)?))
}

/// The data holds sequences of `model.frames + 1` frames of the model's
/// input shape.
pub fn check_data_fits_frame_model(
    config: &ExperimentConfig,
    frames: usize,
    data: &dyn Dataset,
) -> Result<()> {
    let [h, w, c] = config.model.input;
    let expected = [(frames + 1) * h, w, c];
    if data.sample_shape() != expected {
        return Err(PipelineError::value(
            "model.frames",
            format!(
                "the data holds samples of shape {:?}, not {} frames of {:?} stacked ({expected:?}); \
                 a frame model trains on data.format = \"moving_fashion_mnist\"",
                data.sample_shape(),
                frames + 1,
                config.model.input
            ),
        ));
    }
    Ok(())
}
