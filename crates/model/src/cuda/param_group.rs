//! Parameters on the GPU: a `ParamGroup` holds, for a contiguous run of
//! parameters that share their weight-decay setting, the f32 master
//! weights, the f32 gradients (kept multiplied by the loss scale, as
//! backward produces them), the f32 moments and, in mixed precision, the
//! f16 compute copy the forward and backward read (in f32 training they
//! read the masters, and there is no copy). A layer's parameter is a range
//! of a group (`CudaSlice::slice`). Two groups (decay, no decay) hold a
//! network's trainable parameters; a third, frozen one
//! (`frozen_from_host`) only their values. The
//! fused AdamW step over them lives in headroom-optim (`FusedAdamW`).

use half::f16;

use super::backend::{CudaBackend, DeviceBuffer};
use super::error::Context;
use super::ops::cast_f32_to_f16_into;
use super::tensor::{AnyView, DType, MAX_ELEMENTS};
use super::{CudaError, CudaResult};

/// One group of parameters sharing a weight-decay setting.
#[derive(Debug)]
pub struct ParamGroup {
    pub decay: bool,
    pub master: DeviceBuffer<f32>,
    pub grad: DeviceBuffer<f32>,
    pub first_moment: DeviceBuffer<f32>,
    pub second_moment: DeviceBuffer<f32>,
    /// The f16 copy the layers read in mixed precision; None in f32
    /// training.
    pub compute: Option<DeviceBuffer<f16>>,
}

impl ParamGroup {
    /// Uploads master weights; gradients and moments start at zero and,
    /// when the layers compute in f16, the compute copy is cast from the
    /// masters.
    pub fn from_host(
        be: &CudaBackend,
        decay: bool,
        values: &[f32],
        compute: DType,
    ) -> CudaResult<Self> {
        if values.len() > MAX_ELEMENTS {
            return Err(CudaError::Unsupported {
                op: "ParamGroup",
                reason: format!("{} parameters exceed {MAX_ELEMENTS}", values.len()),
            });
        }
        let master = be.upload(values)?;
        let compute = match compute {
            DType::F16 => {
                let mut copy = be.alloc::<f16>(values.len())?;
                cast_f32_to_f16_into(be, &master.slice.as_view(), &mut copy.slice.as_view_mut())?;
                Some(copy)
            }
            DType::F32 => None,
        };
        Ok(Self {
            decay,
            master,
            grad: be.alloc_zeros(values.len())?,
            first_moment: be.alloc_zeros(values.len())?,
            second_moment: be.alloc_zeros(values.len())?,
            compute,
        })
    }

    /// A group of frozen parameters: masters and (in mixed precision) the
    /// compute copy, with one-element placeholders for the gradient and
    /// moments (never read: the optimizer is not given this group).
    pub fn frozen_from_host(be: &CudaBackend, values: &[f32], compute: DType) -> CudaResult<Self> {
        // Every group has device buffers, an empty one a single zero.
        let values = if values.is_empty() {
            &[0.0][..]
        } else {
            values
        };
        let mut group = Self::from_host(be, false, &[0.0], DType::F32)?;
        if values.len() > MAX_ELEMENTS {
            return Err(CudaError::Unsupported {
                op: "ParamGroup",
                reason: format!("{} frozen parameters exceed {MAX_ELEMENTS}", values.len()),
            });
        }
        group.master = be.upload(values)?;
        if compute == DType::F16 {
            let mut copy = be.alloc::<f16>(values.len())?;
            cast_f32_to_f16_into(
                be,
                &group.master.slice.as_view(),
                &mut copy.slice.as_view_mut(),
            )?;
            group.compute = Some(copy);
        }
        Ok(group)
    }

    pub fn len(&self) -> usize {
        self.master.len()
    }

    pub fn is_empty(&self) -> bool {
        self.master.is_empty()
    }

    /// The weights the layers compute with: the f16 copy, or the masters.
    pub fn weights(&self, range: std::ops::Range<usize>) -> AnyView<'_> {
        match &self.compute {
            Some(copy) => AnyView::F16(copy.slice.slice(range)),
            None => AnyView::F32(self.master.slice.slice(range)),
        }
    }

    /// Casts the masters into the f16 copy again (after they were replaced);
    /// nothing to do without a copy.
    pub fn refresh_compute(&mut self, be: &CudaBackend) -> CudaResult<()> {
        match &mut self.compute {
            Some(copy) => cast_f32_to_f16_into(
                be,
                &self.master.slice.as_view(),
                &mut copy.slice.as_view_mut(),
            ),
            None => Ok(()),
        }
    }

    /// Sets the gradients to zero (compute stream).
    pub fn zero_grad(&mut self, be: &CudaBackend) -> CudaResult<()> {
        if !self.grad.is_empty() {
            be.compute_stream()
                .memset_zeros(&mut self.grad.slice)
                .during("cuMemsetD8Async")?;
        }
        Ok(())
    }

    /// Master weights, downloaded (for checkpoints and tests).
    pub fn read_master(&self, be: &CudaBackend) -> CudaResult<Vec<f32>> {
        be.download(&self.master.slice)
    }

    /// (first, second) moments, downloaded.
    pub fn read_moments(&self, be: &CudaBackend) -> CudaResult<(Vec<f32>, Vec<f32>)> {
        Ok((
            be.download(&self.first_moment.slice)?,
            be.download(&self.second_moment.slice)?,
        ))
    }

    /// The weights the layers compute with, downloaded as f32.
    pub fn read_compute(&self, be: &CudaBackend) -> CudaResult<Vec<f32>> {
        match &self.compute {
            Some(copy) => {
                let half = be.half();
                Ok(be
                    .download(&copy.slice)?
                    .into_iter()
                    .map(|h| half.decode(h))
                    .collect())
            }
            None => self.read_master(be),
        }
    }
}
