//! Global average pooling: [N, H, W, C] -> [N, C], the mean over H and W of
//! each channel. A training forward saves only the input's shape: backward
//! spreads each gradient evenly over the H·W positions it came from.

use rayon::prelude::*;

use crate::ops::activation::relu::{par_build, PAR_CHUNK};
use crate::{Layer, Mode, ModelError, Result, Tensor};

#[derive(Default)]
pub struct GlobalAvgPool {
    /// Input shape [n, h, w, c] of the last training forward.
    saved_shape: Option<[usize; 4]>,
}

impl GlobalAvgPool {
    pub fn new() -> Self {
        Self { saved_shape: None }
    }
}

fn image_shape(op: &'static str, shape: &[usize]) -> Result<[usize; 4]> {
    match *shape {
        [n, h, w, c] => Ok([n, h, w, c]),
        _ => Err(ModelError::Shape {
            op,
            expected: "an NHWC image batch [n, h, w, c]".into(),
            got: format!("{shape:?}"),
        }),
    }
}

impl Layer for GlobalAvgPool {
    cuda_form!(value crate::ops::pool::layer::GlobalAvgPoolLayer);

    fn describe(&self) -> String {
        "global_avg_pool".into()
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        match *input {
            [_, _, c] => Ok(vec![c]),
            _ => Err(ModelError::Shape {
                op: "global_avg_pool",
                expected: "an image [h, w, c]".into(),
                got: format!("{input:?}"),
            }),
        }
    }

    /// Additions only, no multiply-adds: pooling counts as 0 like the other
    /// elementwise layers; MACs measure the matrix products.
    fn macs(&self, input: &[usize]) -> Result<u64> {
        self.output_shape(input)?;
        Ok(0)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.saved_shape = None;
        let [n, h, w, c] = image_shape("global_avg_pool", input.shape())?;
        let hw = h * w;
        let mut out = Tensor::try_zeros(&[n, c])?;
        if c > 0 && hw > 0 {
            let scale = 1.0 / hw as f32;
            let x = input.data();
            let out = out.try_data_mut()?;
            // One sample per task; within a sample, rows of C contiguous
            // channels are summed in order (vectorised over C).
            out.par_chunks_mut(c)
                .zip(x.par_chunks(hw * c))
                .with_min_len(8)
                .for_each(|(o, sample)| {
                    for row in sample.chunks_exact(c) {
                        for (acc, &v) in o.iter_mut().zip(row) {
                            *acc += v;
                        }
                    }
                    for v in o.iter_mut() {
                        *v *= scale;
                    }
                });
        }
        self.saved_shape = match mode {
            Mode::Train => Some([n, h, w, c]),
            Mode::Eval => None,
        };
        Ok(out)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let [n, h, w, c] = self
            .saved_shape
            .take()
            .ok_or(ModelError::NoSavedActivation {
                op: "global_avg_pool",
            })?;
        grad_output.expect_shape("global_avg_pool backward", &[n, c])?;
        let hw = h * w;
        let sample = hw * c;
        let scale = 1.0 / hw.max(1) as f32;
        let g = grad_output.data();
        let per_task = (PAR_CHUNK / sample.max(1)).max(1) * sample;
        // SAFETY: tasks hold whole samples (per_task and offsets are multiples
        // of `sample`); within a sample every row of c elements is written
        // from the sample's c gradients.
        unsafe {
            par_build(&[n, h, w, c], per_task, |offset, out| {
                let first = offset / sample.max(1);
                for (s, gi) in out.chunks_exact_mut(sample.max(1)).enumerate() {
                    let g = &g[(first + s) * c..(first + s + 1) * c];
                    for row in gi.chunks_exact_mut(c.max(1)) {
                        for (d, &v) in row.iter_mut().zip(g) {
                            d.write(v * scale);
                        }
                    }
                }
            })
        }
    }

    fn clear_saved(&mut self) {
        self.saved_shape = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::check_layer;
    use crate::gradcheck::random_tensor as random;

    #[test]
    fn averages_each_channel_over_space() {
        // n=2, h=1, w=2, c=3
        let x = Tensor::from_vec(
            &[2, 1, 2, 3],
            vec![
                1.0, 2.0, 3.0, 3.0, 4.0, 5.0, -1.0, 0.0, 10.0, 1.0, 0.0, 20.0,
            ],
        )
        .unwrap();
        let y = GlobalAvgPool::new().forward(&x, Mode::Eval).unwrap();
        assert_eq!(y.shape(), &[2, 3]);
        assert_eq!(y.data(), &[2.0, 3.0, 4.0, 0.0, 0.0, 15.0]);
    }

    #[test]
    fn backward_spreads_the_gradient_evenly() {
        let mut pool = GlobalAvgPool::new();
        pool.forward(&Tensor::zeros(&[1, 2, 2, 2]), Mode::Train)
            .unwrap();
        let g = Tensor::from_vec(&[1, 2], vec![4.0, -8.0]).unwrap();
        let gi = pool.backward(&g).unwrap();
        assert_eq!(gi.shape(), &[1, 2, 2, 2]);
        assert_eq!(gi.data(), &[1.0, -2.0, 1.0, -2.0, 1.0, -2.0, 1.0, -2.0]);
        assert!(matches!(
            pool.backward(&g),
            Err(ModelError::NoSavedActivation { .. })
        ));
    }

    #[test]
    fn shapes_are_checked() {
        let pool = GlobalAvgPool::new();
        assert_eq!(pool.output_shape(&[7, 7, 128]).unwrap(), vec![128]);
        let err = pool.output_shape(&[128]).unwrap_err();
        assert!(err.to_string().contains("global_avg_pool"), "{err}");
        let mut pool = GlobalAvgPool::new();
        let err = pool
            .forward(&Tensor::zeros(&[2, 3]), Mode::Train)
            .unwrap_err();
        assert!(err.to_string().contains("global_avg_pool"), "{err}");
        pool.forward(&Tensor::zeros(&[2, 3, 3, 4]), Mode::Train)
            .unwrap();
        let err = pool.backward(&Tensor::zeros(&[2, 5])).unwrap_err();
        assert!(
            err.to_string().contains("global_avg_pool backward"),
            "{err}"
        );
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let mut pool = GlobalAvgPool::new();
        let x = random(&[3, 4, 5, 6], 11);
        let report = check_layer(&mut pool, &x, 1e-2, 1e-3);
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }
}
