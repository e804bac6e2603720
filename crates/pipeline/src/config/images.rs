//! `data.format = "image_folder"`: what each photo becomes
//! (`data.image_size`, `data.channels`, `data.fit`) and the checks that
//! these keys describe the images the model reads.

use headroom_model::ModelSpec;

use super::{DataConfig, DataFormat};
use crate::{PipelineError, Result};

/// The largest side `data.image_size` takes: beyond it the numbers are
/// a photo's pixels, not a model's input.
const MAX_IMAGE_SIDE: usize = 4096;

impl DataConfig {
    /// What each photo of an image folder becomes: `data.image_size`,
    /// `data.channels`, `data.fit` or their defaults (28×28, gray, center
    /// crop).
    pub fn image_folder(&self) -> headroom_loader::ImageFolderConfig {
        let defaults = headroom_loader::ImageFolderConfig::default();
        headroom_loader::ImageFolderConfig {
            size: self.image_size.unwrap_or(defaults.size),
            channels: self.channels.unwrap_or(defaults.channels),
            fit: self.fit.map_or(defaults.fit, Into::into),
        }
    }

    /// The image keys belong to `data.format = "image_folder"`; there they
    /// must describe images the model reads (`model.input = [h, w, c]`).
    pub(super) fn check_image_keys(&self, model: &ModelSpec) -> Result<()> {
        if self.format != DataFormat::ImageFolder {
            let set = [
                ("data.image_size", self.image_size.is_some()),
                ("data.channels", self.channels.is_some()),
                ("data.fit", self.fit.is_some()),
            ];
            if let Some((key, _)) = set.iter().find(|(_, set)| *set) {
                return Err(PipelineError::value(
                    key,
                    format!(
                        "applies to data.format = \"image_folder\" only (data.format is \"{}\"): remove it",
                        self.format
                    ),
                ));
            }
            return Ok(());
        }
        if self.dir.is_none() {
            return Err(PipelineError::value(
                "data.dir",
                "data.format = \"image_folder\" needs data.dir: a folder holding train/ and test/, \
                 each with one subfolder of images per class",
            ));
        }
        if self.train_samples > 0 || self.test_samples > 0 {
            return Err(PipelineError::value(
                "data.train_samples",
                "sample limits apply to \"idx\" data only; use a smaller image folder instead",
            ));
        }
        let images = self.image_folder();
        let [h, w] = images.size;
        if !(1..=MAX_IMAGE_SIDE).contains(&h) || !(1..=MAX_IMAGE_SIDE).contains(&w) {
            return Err(PipelineError::value(
                "data.image_size",
                format!("[{h}, {w}]: expected [height, width], each from 1 to {MAX_IMAGE_SIDE}"),
            ));
        }
        let c = images.channels;
        if c != 1 && c != 3 {
            return Err(PipelineError::value(
                "data.channels",
                format!("expected 1 (grayscale) or 3 (RGB), got {c}"),
            ));
        }
        if model.tokens.is_some() || model.frames.is_some() {
            return Err(PipelineError::value(
                "data.format",
                "\"image_folder\" trains an image classifier; a token or frame model \
                 (model.tokens, model.frames) cannot read it",
            ));
        }
        let [mh, mw, mc] = model.input;
        if mc != c {
            let colour = if c == 1 { "grayscale" } else { "RGB" };
            return Err(PipelineError::value(
                "model.input",
                format!(
                    "{:?} takes {mc} channel(s), but data.channels = {c} ({colour} images): \
                     set model.input = [{mh}, {mw}, {c}], or data.channels = {mc}",
                    model.input
                ),
            ));
        }
        if [mh, mw] != [h, w] {
            return Err(PipelineError::value(
                "model.input",
                format!(
                    "{:?} takes {mh}×{mw} images, but data.image_size = [{h}, {w}]: \
                     set model.input = [{h}, {w}, {c}], or data.image_size = [{mh}, {mw}]",
                    model.input
                ),
            ));
        }
        Ok(())
    }
}
