//! The experiment's word-valued settings as enums: `data.format`,
//! `data.fit`, `memory.oom_policy` and `run.profile` (`device.kind` is
//! `crate::device::DeviceKind`, `device.conv_algorithm` the model's
//! `ConvAlgorithm`). Each reads and writes the word the TOML holds.

use crate::setting_enum::setting_enum;

setting_enum! {
    /// What `data.dir` holds (`data.format`).
    #[derive(Default)]
    pub enum DataFormat {
        /// MNIST-format IDX files (Fashion-MNIST).
        #[default]
        Idx = "idx",
        /// A store written by `cargo xtask preprocess`, with train/ and
        /// test/ inside.
        Shards = "shards",
        /// The `[text]` corpus, packed into a shard store on first use.
        Text = "text",
        /// `[frames]` sequences made from Fashion-MNIST.
        MovingFashionMnist = "moving_fashion_mnist",
        /// A folder of PNG and JPEG photos with train/ and test/ inside,
        /// each holding one subfolder per class, decoded as read.
        ImageFolder = "image_folder",
        /// `train.csv` and `test.csv` in `data.dir`: numeric feature
        /// columns and the `data.targets` columns, read whole.
        Csv = "csv",
        /// `train/` and `test/` in `data.dir`, each a directory of `.npz`,
        /// `.safetensors` or `.npy`-pair files holding an input array and a
        /// target array, read lazily through a cache of decoded files.
        Tensors = "tensors",
    }
}

setting_enum! {
    /// How a photo of another size is fit to `data.image_size`
    /// (`data.fit`, for `data.format = "image_folder"`).
    #[derive(Default)]
    pub enum ImageFit {
        /// Scale so the shorter side fits, then keep the center: nothing is
        /// distorted, the edges of the longer side are cut.
        #[default]
        CenterCrop = "center_crop",
        /// Stretch to exactly the size (the aspect ratio may change).
        Resize = "resize",
    }
}

impl From<ImageFit> for headroom_loader::ImageFit {
    fn from(fit: ImageFit) -> Self {
        match fit {
            ImageFit::CenterCrop => headroom_loader::ImageFit::CenterCrop,
            ImageFit::Resize => headroom_loader::ImageFit::Resize,
        }
    }
}

setting_enum! {
    /// What an unreadable sample leads to (`data.bad_samples`).
    #[derive(Default)]
    pub enum BadSamples {
        /// An error naming the file (and row) before training.
        #[default]
        Fail = "fail",
        /// Left out, each named in the log and the run's `dataset.json`;
        /// a class left with no sample is still an error.
        Skip = "skip",
    }
}

setting_enum! {
    /// What an out-of-memory error leads to (`memory.oom_policy`).
    #[derive(Default)]
    pub enum OomPolicy {
        /// Free the cache and retry, then halve the micro-batch (doubling
        /// accumulation) down to `min_micro_batch`, then checkpoint and stop.
        #[default]
        Adapt = "adapt",
        /// Checkpoint and stop at the first out-of-memory.
        Stop = "stop",
    }
}

/// `run.profile`: "auto" (the low-memory profile on a device under 4 GiB),
/// "none", or the name of a profile file beside the experiment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Profile {
    #[default]
    Auto,
    None,
    /// `profiles/<name>.toml` beside the experiment (checked when read).
    Named(String),
}

impl Profile {
    /// The word the TOML holds.
    pub fn as_str(&self) -> &str {
        match self {
            Profile::Auto => "auto",
            Profile::None => "none",
            Profile::Named(name) => name,
        }
    }

    fn from_word(word: String) -> Self {
        match word.as_str() {
            "auto" => Profile::Auto,
            "none" => Profile::None,
            _ => Profile::Named(word),
        }
    }
}

impl std::fmt::Display for Profile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl serde::Serialize for Profile {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for Profile {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        <String as serde::Deserialize>::deserialize(deserializer).map(Profile::from_word)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_setting_round_trips_through_its_word() {
        for format in [
            DataFormat::Idx,
            DataFormat::Shards,
            DataFormat::Text,
            DataFormat::MovingFashionMnist,
            DataFormat::ImageFolder,
        ] {
            let word = toml::Value::try_from(format).unwrap();
            assert_eq!(word.as_str(), Some(format.as_str()));
            assert_eq!(word.try_into::<DataFormat>().unwrap(), format);
        }
        for fit in [ImageFit::CenterCrop, ImageFit::Resize] {
            let word = toml::Value::try_from(fit).unwrap();
            assert_eq!(word.as_str(), Some(fit.as_str()));
            assert_eq!(word.try_into::<ImageFit>().unwrap(), fit);
        }
        for profile in [
            Profile::Auto,
            Profile::None,
            Profile::Named("low_memory".into()),
        ] {
            let word = toml::Value::try_from(&profile).unwrap();
            assert_eq!(word.as_str(), Some(profile.as_str()));
            assert_eq!(word.try_into::<Profile>().unwrap(), profile);
        }
    }

    #[test]
    fn an_unknown_word_is_refused_with_the_known_ones() {
        let err = toml::Value::String("panic".into())
            .try_into::<OomPolicy>()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("expected \"adapt\" or \"stop\", got \"panic\""),
            "{err}"
        );
    }
}
