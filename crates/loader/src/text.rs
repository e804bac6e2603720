//! Byte-level text as a dataset of next-token windows.
//!
//! A text sample is a window of `length + 1` consecutive bytes, stored as a
//! `[1, length + 1, 1]` u8 "image" with label 0: the model reads the first
//! `length` bytes and is scored on the last `length` (each position predicts
//! the byte after it; [`crate::Batch::next_token_pairs`] splits a batch so).
//! Windows start every `length` bytes, so consecutive windows share one byte
//! and every byte after the first is a target exactly once. Keeping the
//! sample a plain u8 array means the shard store, its index and its LRU cache
//! carry text unchanged, and the image path is untouched.

use crate::{Dataset, LoaderError};

/// Byte-level vocabulary: every byte value is a token.
pub const BYTE_VOCAB: usize = 256;

/// Windows of `length + 1` bytes over a text held in memory (what
/// `preprocess` packs into a shard store).
#[derive(Clone, Debug)]
pub struct TextWindows {
    bytes: Vec<u8>,
    length: usize,
    count: usize,
}

impl TextWindows {
    /// The windows of `bytes` for a model reading `length` tokens, at most
    /// `limit` of them (0 = all). A text shorter than one window is an
    /// error naming `what` (the file or split it came from).
    pub fn new(
        bytes: Vec<u8>,
        length: usize,
        limit: usize,
        what: &str,
    ) -> Result<Self, LoaderError> {
        if length == 0 {
            return Err(LoaderError::Config {
                field: "length",
                message: "a window needs at least one token".into(),
            });
        }
        let available = bytes.len().saturating_sub(1) / length;
        if available == 0 {
            return Err(LoaderError::Config {
                field: "text",
                message: format!(
                    "{what}: {} bytes is shorter than one window of {} bytes (the model's length + 1)",
                    bytes.len(),
                    length + 1
                ),
            });
        }
        let count = match limit {
            0 => available,
            n => n.min(available),
        };
        Ok(Self {
            bytes,
            length,
            count,
        })
    }

    /// Tokens the model reads per window.
    pub fn length(&self) -> usize {
        self.length
    }
}

impl Dataset for TextWindows {
    fn len(&self) -> usize {
        self.count
    }

    fn sample_shape(&self) -> [usize; 3] {
        [1, self.length + 1, 1]
    }

    fn num_classes(&self) -> usize {
        BYTE_VOCAB
    }

    fn fingerprint(&self) -> Option<u32> {
        let mut digest = crc32fast::Hasher::new();
        digest.update(&self.bytes);
        digest.update(&(self.length as u64).to_le_bytes());
        digest.update(&(self.count as u64).to_le_bytes());
        Some(digest.finalize())
    }

    fn read(&self, index: usize, out: &mut [u8]) -> Result<u32, LoaderError> {
        if index >= self.count {
            return Err(LoaderError::Index {
                index,
                len: self.count,
            });
        }
        let window = self.length + 1;
        if out.len() != window {
            return Err(LoaderError::Buffer {
                index,
                actual: out.len(),
                expected: window,
            });
        }
        let start = index * self.length;
        out.copy_from_slice(&self.bytes[start..start + window]);
        Ok(0)
    }
}

/// Splits a text into (training, validation): validation is the last
/// `fraction` of the bytes, so the split is the same on every machine and
/// no window of one part overlaps the other.
pub fn split_for_validation(bytes: &[u8], fraction: f64) -> (&[u8], &[u8]) {
    let held_out = (bytes.len() as f64 * fraction.clamp(0.0, 1.0)).round() as usize;
    bytes.split_at(bytes.len() - held_out.min(bytes.len()))
}

/// The sequence length of a dataset of text windows (`[1, length + 1, 1]`
/// samples), or None when its samples are not windows (images).
pub fn window_length(sample_shape: [usize; 3]) -> Option<usize> {
    match sample_shape {
        [1, window, 1] if window >= 2 => Some(window - 1),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn windows(text: &[u8], length: usize) -> TextWindows {
        TextWindows::new(text.to_vec(), length, 0, "test text").unwrap()
    }

    #[test]
    fn windows_step_by_length_and_overlap_by_one_byte() {
        let text = windows(b"abcdefghij", 3);
        assert_eq!(text.len(), 3);
        assert_eq!(text.sample_shape(), [1, 4, 1]);
        let mut out = [0u8; 4];
        let read: Vec<Vec<u8>> = (0..3)
            .map(|i| {
                assert_eq!(text.read(i, &mut out).unwrap(), 0);
                out.to_vec()
            })
            .collect();
        assert_eq!(read, [b"abcd".to_vec(), b"defg".to_vec(), b"ghij".to_vec()]);
    }

    #[test]
    fn a_limit_keeps_the_first_windows() {
        let text = TextWindows::new(b"abcdefghij".to_vec(), 3, 2, "t").unwrap();
        assert_eq!(text.len(), 2);
        assert!(matches!(
            text.read(2, &mut [0u8; 4]),
            Err(LoaderError::Index { index: 2, len: 2 })
        ));
    }

    #[test]
    fn text_shorter_than_a_window_is_an_error_naming_it() {
        let err = TextWindows::new(b"abc".to_vec(), 3, 0, "riddles")
            .unwrap_err()
            .to_string();
        assert!(err.contains("riddles") && err.contains("4 bytes"), "{err}");
    }

    #[test]
    fn validation_is_the_tail_and_the_split_is_deterministic() {
        let text: Vec<u8> = (0..100u8).collect();
        let (train, validation) = split_for_validation(&text, 0.05);
        assert_eq!(train.len(), 95);
        assert_eq!(validation, &text[95..]);
        assert_eq!(split_for_validation(&text, 0.05), (train, validation));
    }

    #[test]
    fn window_length_tells_windows_from_images() {
        assert_eq!(window_length([1, 65, 1]), Some(64));
        assert_eq!(window_length([28, 28, 1]), None);
    }
}
