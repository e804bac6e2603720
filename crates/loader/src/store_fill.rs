//! Reading a source's samples for `preprocess` on every core: a block of
//! consecutive samples (about 4 MiB) is split among scoped threads, each
//! reading (decoding, for images) its part into its own slice of one
//! buffer, and the block is then written in sample order. The store's
//! bytes are those of a one-thread read; the first error is the one of the
//! lowest sample id, as a one-thread read would meet it. Memory: one block.

use crate::{Dataset, LoaderError};

/// Bytes read per block.
const BLOCK_BYTES: usize = 4 << 20;

pub(crate) struct BlockReader {
    sample_len: usize,
    threads: usize,
    block: usize,
    buf: Vec<u8>,
    labels: Vec<u32>,
}

impl BlockReader {
    /// A reader of `sample_len`-byte records on every core.
    pub fn new(sample_len: usize) -> Result<Self, LoaderError> {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::with_threads(sample_len, threads)
    }

    pub fn with_threads(sample_len: usize, threads: usize) -> Result<Self, LoaderError> {
        let threads = threads.max(1);
        let block = (BLOCK_BYTES / sample_len.max(1)).clamp(threads, 1 << 16);
        let mut buf = Vec::new();
        buf.try_reserve_exact(block * sample_len)
            .map_err(|e| LoaderError::Config {
                field: "dataset",
                message: format!(
                    "a block of {block} samples of {sample_len} bytes cannot be held in memory: {e}"
                ),
            })?;
        buf.resize(block * sample_len, 0);
        Ok(Self {
            sample_len,
            threads,
            block,
            buf,
            labels: vec![0; block],
        })
    }

    pub fn sample_len(&self) -> usize {
        self.sample_len
    }

    /// Samples per block: the most [`BlockReader::read`] takes at once.
    pub fn block(&self) -> usize {
        self.block
    }

    /// Reads samples `first .. first + n` (`n <= block()`): their records,
    /// one after the other, and their labels, each below `classes`.
    pub fn read(
        &mut self,
        source: &dyn Dataset,
        first: usize,
        n: usize,
        classes: usize,
    ) -> Result<(&[u8], &[u32]), LoaderError> {
        let len = self.sample_len;
        let (buf, labels) = (&mut self.buf[..n * len], &mut self.labels[..n]);
        let per_thread = n.div_ceil(self.threads).max(1);
        if self.threads == 1 || n < 2 {
            read_part(source, first, buf, labels, len, classes).map_err(Part::into_error)?;
        } else {
            let results = std::thread::scope(|scope| {
                let handles: Vec<_> = buf
                    .chunks_mut(per_thread * len)
                    .zip(labels.chunks_mut(per_thread))
                    .enumerate()
                    .map(|(t, (buf, labels))| {
                        let start = first + t * per_thread;
                        let work = move || read_part(source, start, buf, labels, len, classes);
                        std::thread::Builder::new()
                            .name(format!("preprocess-{t}"))
                            .spawn_scoped(scope, work)
                            .map_err(|_| t)
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|handle| match handle {
                        Ok(handle) => handle.join().unwrap_or(Err(Part::Panicked)),
                        Err(t) => Err(Part::NotStarted(t)),
                    })
                    .collect::<Vec<_>>()
            });
            // In sample order: the first failure is the lowest sample id's,
            // as one thread would have met it; a part whose thread did not
            // start is read here instead (slower, the same bytes).
            for result in results {
                match result {
                    Ok(()) => {}
                    Err(Part::NotStarted(t)) => {
                        let (at, end) = (t * per_thread, ((t + 1) * per_thread).min(n));
                        read_part(
                            source,
                            first + at,
                            &mut self.buf[at * len..end * len],
                            &mut self.labels[at..end],
                            len,
                            classes,
                        )
                        .map_err(Part::into_error)?;
                    }
                    Err(part) => return Err(part.into_error()),
                }
            }
        }
        Ok((&self.buf[..n * len], &self.labels[..n]))
    }
}

/// How one thread's part of a block failed.
enum Part {
    Read(LoaderError),
    /// Its thread could not start (part `t`).
    NotStarted(usize),
    Panicked,
}

impl Part {
    fn into_error(self) -> LoaderError {
        match self {
            Part::Read(e) => e,
            Part::NotStarted(_) | Part::Panicked => LoaderError::Config {
                field: "dataset",
                message: "a preprocessing thread failed".into(),
            },
        }
    }
}

fn read_part(
    source: &dyn Dataset,
    first: usize,
    buf: &mut [u8],
    labels: &mut [u32],
    len: usize,
    classes: usize,
) -> Result<(), Part> {
    for (i, (record, label)) in buf.chunks_exact_mut(len).zip(labels.iter_mut()).enumerate() {
        let index = first + i;
        *label = source.read(index, record).map_err(Part::Read)?;
        if *label as usize >= classes {
            return Err(Part::Read(LoaderError::Label {
                index,
                label: *label,
                num_classes: classes,
            }));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SyntheticDataset;

    #[test]
    fn a_block_read_on_several_threads_is_the_one_thread_read() {
        let source = SyntheticDataset::new(1000, [4, 4, 1], 7);
        let mut one = BlockReader::with_threads(16, 1).unwrap();
        let mut four = BlockReader::with_threads(16, 4).unwrap();
        for (first, n) in [(0, 1), (3, 250), (500, 499)] {
            let (a, la) = one.read(&source, first, n, 7).unwrap();
            let (a, la) = (a.to_vec(), la.to_vec());
            let (b, lb) = four.read(&source, first, n, 7).unwrap();
            assert_eq!((a.as_slice(), la.as_slice()), (b, lb));
            assert_eq!(la[0], source.sample(first).1);
        }
        // Past the end: the error of the first id out of range.
        let err = four.read(&source, 990, 20, 7).unwrap_err();
        assert!(
            matches!(err, LoaderError::Index { index: 1000, .. }),
            "{err}"
        );
        // Labels are i % 7: 997's is the first out of 3 classes, and its
        // error comes before the read errors past 1000.
        let err = four.read(&source, 995, 10, 3).unwrap_err();
        assert!(
            matches!(
                err,
                LoaderError::Label {
                    index: 997,
                    label: 3,
                    ..
                }
            ),
            "{err}"
        );
    }
}
