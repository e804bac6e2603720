//! Max pooling: [N, H, W, C] -> [N, OH, OW, C] with OH = ⌊(H - k)/s⌋ + 1
//! (OW alike), no padding: each output is the largest of the k×k input
//! values of its window, channel by channel.
//!
//! Ties (and the argmax): the FIRST largest value in row-major window order
//! (ky, then kx) wins: a later value replaces the running maximum only when
//! strictly greater. A NaN therefore wins only where it is first in its
//! window (no comparison with it is true). The CUDA kernels
//! (`pool.cu`) use the same order and comparison, so the argmax and
//! the forward agree bit for bit.
//!
//! Backward routes each output gradient to its argmax input; where windows
//! overlap (stride < kernel) an input sums the gradients routed to it, in
//! row-major output order (oy, then ox), starting from 0. The kernels gather
//! in that same order.
//!
//! Memory: a training forward keeps one u32 per output element (the argmax's
//! position ky·k + kx in its window) and the input's shape, never the input.

use rayon::prelude::*;

use crate::memory::try_scratch;
use crate::{Layer, Mode, ModelError, Result, Tensor};

/// Output side of max pooling over `side` inputs, or None if the kernel
/// does not fit (or kernel or stride is 0).
pub fn max_pool_out_side(side: usize, kernel: usize, stride: usize) -> Option<usize> {
    if kernel == 0 || stride == 0 {
        return None;
    }
    side.checked_sub(kernel).map(|r| r / stride + 1)
}

struct Saved {
    /// [n, h, w, c] of the input.
    shape: [usize; 4],
    /// Per output element, its argmax's position ky·k + kx in its window.
    argmax: Vec<u32>,
}

pub struct MaxPool2d {
    pub(crate) kernel: usize,
    pub(crate) stride: usize,
    saved: Option<Saved>,
}

impl MaxPool2d {
    /// Panics on a zero kernel or stride (the builder checks the spec first).
    pub fn new(kernel: usize, stride: usize) -> Self {
        assert!(kernel > 0 && stride > 0, "max_pool: kernel and stride > 0");
        Self {
            kernel,
            stride,
            saved: None,
        }
    }

    fn out_hw(&self, op: &'static str, h: usize, w: usize) -> Result<(usize, usize)> {
        match (
            max_pool_out_side(h, self.kernel, self.stride),
            max_pool_out_side(w, self.kernel, self.stride),
        ) {
            (Some(oh), Some(ow)) => Ok((oh, ow)),
            _ => Err(ModelError::Shape {
                op,
                expected: format!("an image at least {k}x{k} (the kernel)", k = self.kernel),
                got: format!("{h}x{w}"),
            }),
        }
    }
}

impl Layer for MaxPool2d {
    cuda_form!(crate::ops::pool::layer::MaxPoolLayer::from_cpu);

    fn describe(&self) -> String {
        format!("max_pool{}x{}/{}", self.kernel, self.kernel, self.stride)
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        match *input {
            [h, w, c] => {
                let (oh, ow) = self.out_hw("max_pool", h, w)?;
                Ok(vec![oh, ow, c])
            }
            _ => Err(ModelError::Shape {
                op: "max_pool",
                expected: "an image [h, w, c]".into(),
                got: format!("{input:?}"),
            }),
        }
    }

    /// Comparisons only: 0 like the other pooling layers.
    fn macs(&self, input: &[usize]) -> Result<u64> {
        self.output_shape(input)?;
        Ok(0)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.saved = None;
        let [n, h, w, c] = match *input.shape() {
            [n, h, w, c] => [n, h, w, c],
            _ => {
                return Err(ModelError::Shape {
                    op: "max_pool",
                    expected: "an NHWC image batch [n, h, w, c]".into(),
                    got: format!("{:?}", input.shape()),
                })
            }
        };
        let (oh, ow) = self.out_hw("max_pool", h, w)?;
        let (k, s) = (self.kernel, self.stride);
        let mut out = Tensor::try_zeros(&[n, oh, ow, c])?;
        let train = mode == Mode::Train;
        let mut argmax: Vec<u32> = if train {
            let mut v = try_scratch(out.len())?;
            v.resize(out.len(), 0);
            v
        } else {
            Vec::new()
        };
        let row = ow * c;
        if row > 0 {
            let x = input.data();
            let out_data = out.try_data_mut()?;
            // One output row (sample, oy) per task: each output depends on
            // its window only, so the split changes no result.
            let body = |r: usize, o: &mut [f32], mut a: Option<&mut [u32]>| {
                let (b, oy) = (r / oh, r % oh);
                let image = &x[b * h * w * c..(b + 1) * h * w * c];
                for ox in 0..ow {
                    for ch in 0..c {
                        let at = |ky: usize, kx: usize| {
                            image[((oy * s + ky) * w + ox * s + kx) * c + ch]
                        };
                        let mut best = at(0, 0);
                        let mut pos = 0u32;
                        for ky in 0..k {
                            for kx in 0..k {
                                let v = at(ky, kx);
                                if v > best {
                                    best = v;
                                    pos = (ky * k + kx) as u32;
                                }
                            }
                        }
                        o[ox * c + ch] = best;
                        if let Some(a) = a.as_deref_mut() {
                            a[ox * c + ch] = pos;
                        }
                    }
                }
            };
            if train {
                out_data
                    .par_chunks_mut(row)
                    .zip(argmax.par_chunks_mut(row))
                    .enumerate()
                    .for_each(|(r, (o, a))| body(r, o, Some(a)));
            } else {
                out_data
                    .par_chunks_mut(row)
                    .enumerate()
                    .for_each(|(r, o)| body(r, o, None));
            }
        }
        if train {
            self.saved = Some(Saved {
                shape: [n, h, w, c],
                argmax,
            });
        }
        Ok(out)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let Saved { shape, argmax } = self
            .saved
            .take()
            .ok_or(ModelError::NoSavedActivation { op: "max_pool" })?;
        let [n, h, w, c] = shape;
        let (oh, ow) = self.out_hw("max_pool backward", h, w)?;
        grad_output.expect_shape("max_pool backward", &[n, oh, ow, c])?;
        let (k, s) = (self.kernel, self.stride);
        let mut dx = Tensor::try_zeros(&shape)?;
        let sample_in = h * w * c;
        let sample_out = oh * ow * c;
        if sample_in > 0 && sample_out > 0 {
            let g = grad_output.data();
            // One sample per task, its outputs in row-major order: where
            // windows overlap, an input's sum runs in that order.
            dx.try_data_mut()?
                .par_chunks_mut(sample_in)
                .zip(g.par_chunks(sample_out))
                .zip(argmax.par_chunks(sample_out))
                .for_each(|((d, g), a)| {
                    for oy in 0..oh {
                        for ox in 0..ow {
                            for ch in 0..c {
                                let i = (oy * ow + ox) * c + ch;
                                let pos = a[i] as usize;
                                let (ky, kx) = (pos / k, pos % k);
                                d[((oy * s + ky) * w + ox * s + kx) * c + ch] += g[i];
                            }
                        }
                    }
                });
        }
        Ok(dx)
    }

    fn clear_saved(&mut self) {
        self.saved = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::check_layer;
    use crate::init::InitRng;

    fn distinct(shape: &[usize], seed: u64) -> Tensor {
        let len: usize = shape.iter().product();
        let mut order: Vec<usize> = (0..len).collect();
        let mut rng = InitRng::new(seed);
        for i in (1..len).rev() {
            order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        let data = order.iter().map(|&v| v as f32 * 0.05 - 2.0).collect();
        Tensor::from_vec(shape, data).unwrap()
    }

    #[test]
    fn takes_the_window_maximum_and_the_first_of_ties() {
        // n=1, 2x4 image, c=1; 2x2 windows at stride 2.
        let x =
            Tensor::from_vec(&[1, 2, 4, 1], vec![1.0, 3.0, 5.0, 5.0, 3.0, 2.0, 5.0, 5.0]).unwrap();
        let mut pool = MaxPool2d::new(2, 2);
        let y = pool.forward(&x, Mode::Train).unwrap();
        assert_eq!(y.shape(), &[1, 1, 2, 1]);
        assert_eq!(y.data(), &[3.0, 5.0]);
        let g = Tensor::from_vec(&[1, 1, 2, 1], vec![10.0, 20.0]).unwrap();
        let dx = pool.backward(&g).unwrap();
        // First window: 3 at (0, 1) beats the later tie 3 at (1, 0).
        // Second: the first of four 5s, (0, 0) of the window.
        assert_eq!(dx.data(), &[0.0, 10.0, 20.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        assert!(matches!(
            pool.backward(&g),
            Err(ModelError::NoSavedActivation { .. })
        ));
    }

    #[test]
    fn overlapping_windows_sum_their_gradients() {
        // A 3x3 image whose centre is in all four 2x2 windows (stride 1).
        let mut x = vec![0.0; 9];
        x[4] = 9.0;
        let x = Tensor::from_vec(&[1, 3, 3, 1], x).unwrap();
        let mut pool = MaxPool2d::new(2, 1);
        let y = pool.forward(&x, Mode::Train).unwrap();
        assert_eq!(y.data(), &[9.0; 4]);
        let g = Tensor::from_vec(&[1, 2, 2, 1], vec![1.0, 2.0, 3.0, 4.0]).unwrap();
        let dx = pool.backward(&g).unwrap();
        assert_eq!(dx.data()[4], 10.0);
        assert_eq!(dx.data().iter().sum::<f32>(), 10.0);
    }

    #[test]
    fn shapes_and_misfits_are_errors() {
        let pool = MaxPool2d::new(2, 2);
        assert_eq!(pool.output_shape(&[7, 6, 16]).unwrap(), vec![3, 3, 16]);
        assert_eq!(
            MaxPool2d::new(3, 2).output_shape(&[7, 7, 4]).unwrap(),
            vec![3, 3, 4]
        );
        let err = MaxPool2d::new(5, 1).output_shape(&[4, 9, 3]).unwrap_err();
        assert!(err.to_string().contains("max_pool"), "{err}");
        assert!(pool.output_shape(&[16]).is_err());
        let mut pool = MaxPool2d::new(2, 2);
        let err = pool
            .forward(&Tensor::zeros(&[2, 3]), Mode::Train)
            .unwrap_err();
        assert!(err.to_string().contains("max_pool"), "{err}");
        pool.forward(&Tensor::zeros(&[2, 4, 4, 3]), Mode::Train)
            .unwrap();
        let err = pool.backward(&Tensor::zeros(&[2, 4, 4, 3])).unwrap_err();
        assert!(err.to_string().contains("max_pool backward"), "{err}");
        // Evaluation keeps nothing.
        pool.forward(&Tensor::zeros(&[2, 4, 4, 3]), Mode::Eval)
            .unwrap();
        assert!(pool.saved.is_none());
    }

    #[test]
    fn gradient_matches_finite_differences() {
        // Distinct values 0.05 apart in a random order, so that no two in a
        // window are within the finite difference's step of each other (a
        // near-tie would be a kink).
        for (k, s, seed) in [(2, 2, 21), (3, 2, 22), (2, 1, 23)] {
            let mut pool = MaxPool2d::new(k, s);
            let x = distinct(&[2, 5, 6, 3], seed);
            let report = check_layer(&mut pool, &x, 1e-2, 1e-3);
            assert!(report.is_ok(), "k {k} s {s}: {}", report.unwrap_err());
        }
    }
}
