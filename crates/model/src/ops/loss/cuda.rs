use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

use crate::cuda::backend::{CudaBackend, DeviceBuffer};
use crate::cuda::kernels::{self as k};
use crate::cuda::launch::*;
use crate::cuda::params::*;
use crate::cuda::tensor::CudaTensor;
use crate::cuda::{CudaError, CudaResult};

// ---------------------------------------------------------------------------
// Loss

/// Per-row results of `softmax_cross_entropy`, all on the device.
#[derive(Debug)]
pub struct XentOutput {
    /// (softmax - target) · loss_scale / rows, [rows, classes] in the
    /// logits' type.
    pub grad: CudaTensor,
    pub row_loss: DeviceBuffer<f32>,
    pub row_correct: DeviceBuffer<u32>,
}

impl XentOutput {
    /// Mean loss and correct count, reduced on the device into one f32 and
    /// one u32 (no host synchronisation).
    pub fn summary(&self, be: &CudaBackend) -> CudaResult<(DeviceBuffer<f32>, DeviceBuffer<u32>)> {
        let mut loss = be.alloc::<f32>(1)?;
        let mut correct = be.alloc::<u32>(1)?;
        self.summary_into(
            be,
            &mut loss.slice.as_view_mut(),
            &mut correct.slice.as_view_mut(),
        )?;
        Ok((loss, correct))
    }

    /// `summary` into `loss[0]` and `correct[0]` (e.g. one micro-batch's
    /// entry of a step's record).
    pub fn summary_into(
        &self,
        be: &CudaBackend,
        loss: &mut CudaViewMut<'_, f32>,
        correct: &mut CudaViewMut<'_, u32>,
    ) -> CudaResult<()> {
        if loss.is_empty() || correct.is_empty() {
            return Err(CudaError::shape(
                "xent_reduce",
                "one f32 and one u32 to write",
                format!("{} and {}", loss.len(), correct.len()),
            ));
        }
        let rows = self.row_loss.len();
        let p = XentReduceParams {
            rows: u32_of("xent_reduce", rows)?,
        };
        let f = be.function(&k::XENT_REDUCE)?;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: xent_reduce(XentReduceParams, const float* row_loss,
        // const u32* row_correct [rows], float* out_loss, u32*
        // out_correct [1]) with exactly one block of 256 threads, as the
        // kernel requires; both outputs hold at least one element.
        unsafe {
            launch(be.compute_stream(), &f, cfg, "xent_reduce", |b| {
                b.arg(&p)
                    .arg(&self.row_loss.slice)
                    .arg(&self.row_correct.slice)
                    .arg(loss)
                    .arg(correct);
            })
        }?;
        Ok(())
    }

    /// `summary`, downloaded (waits for the compute stream): (mean loss,
    /// correct count).
    pub fn read_summary(&self, be: &CudaBackend) -> CudaResult<(f32, u32)> {
        let (loss, correct) = self.summary(be)?;
        let loss = be.download(&loss.slice)?;
        let correct = be.download(&correct.slice)?;
        Ok((loss[0], correct[0]))
    }
}

/// What a loss kernel multiplies its gradient by, besides 1 / rows: the
/// dynamic loss scale, read from device memory when the kernel runs (the
/// optimizer keeps it there, so a step never waits for the host to learn
/// it), and this micro-batch's share of the batch.
#[derive(Clone, Copy, Debug)]
pub struct GradScale<'a> {
    /// One f32.
    pub loss_scale: &'a CudaSlice<f32>,
    pub share: f32,
}

impl GradScale<'_> {
    /// The loss kernels read one f32 of scale.
    pub(crate) fn check(&self, op: &'static str) -> CudaResult<()> {
        match self.loss_scale.len() {
            1 => Ok(()),
            len => Err(CudaError::shape(
                op,
                "a loss scale of one f32",
                format!("{len} values"),
            )),
        }
    }
}

/// Softmax cross-entropy with label smoothing, forward and gradient in one
/// kernel. `labels` are class indices on the device (use
/// `upload_labels`, which validates them); the gradient is multiplied by
/// `scale` (dynamic loss scaling) and divided by the batch size.
pub fn softmax_cross_entropy(
    be: &CudaBackend,
    logits: &CudaTensor,
    labels: &CudaView<'_, u32>,
    smoothing: f32,
    scale: GradScale<'_>,
) -> CudaResult<XentOutput> {
    let (n, _) = xent_shape(logits)?;
    same_len("cross_entropy", "labels", n, labels.len())?;
    if !(0.0..1.0).contains(&smoothing) {
        return Err(CudaError::shape(
            "cross_entropy",
            "label smoothing in [0, 1)",
            format!("{smoothing}"),
        ));
    }
    xent_launch(
        be,
        logits,
        XentTarget::Labels(labels),
        smoothing,
        None,
        scale,
    )
}

/// Focal loss with label smoothing (`loss::focal_loss`): the targets of
/// `softmax_cross_entropy`, each class's log-probability weighted by
/// (1 − p)^gamma; the gradient scaled as there. gamma = 0 is the
/// cross-entropy.
pub fn focal_loss(
    be: &CudaBackend,
    logits: &CudaTensor,
    labels: &CudaView<'_, u32>,
    smoothing: f32,
    gamma: f32,
    scale: GradScale<'_>,
) -> CudaResult<XentOutput> {
    let (n, _) = xent_shape(logits)?;
    same_len("focal_loss", "labels", n, labels.len())?;
    if !(0.0..1.0).contains(&smoothing) {
        return Err(CudaError::shape(
            "focal_loss",
            "label smoothing in [0, 1)",
            format!("{smoothing}"),
        ));
    }
    let gamma = focal_gamma(gamma)?;
    xent_launch(
        be,
        logits,
        XentTarget::Labels(labels),
        smoothing,
        Some(gamma),
        scale,
    )
}

/// Focal loss against soft targets (`loss::soft_focal_loss`), `targets`
/// as in `soft_cross_entropy`.
pub fn soft_focal_loss(
    be: &CudaBackend,
    logits: &CudaTensor,
    targets: &CudaView<'_, f32>,
    gamma: f32,
    scale: GradScale<'_>,
) -> CudaResult<XentOutput> {
    let (n, classes) = xent_shape(logits)?;
    same_len("soft_focal_loss", "targets", n * classes, targets.len())?;
    let gamma = focal_gamma(gamma)?;
    xent_launch(
        be,
        logits,
        XentTarget::Soft(targets),
        0.0,
        Some(gamma),
        scale,
    )
}

fn focal_gamma(gamma: f32) -> CudaResult<f32> {
    if gamma >= 0.0 && gamma.is_finite() {
        Ok(gamma)
    } else {
        Err(CudaError::shape(
            "focal_loss",
            "gamma finite and >= 0",
            format!("{gamma}"),
        ))
    }
}

/// Cross-entropy against soft targets (Mixup, CutMix): `targets` [n, k]
/// f32 on the device, smoothing already applied; the CPU's
/// `loss::soft_cross_entropy`. The gradient is scaled as in
/// `softmax_cross_entropy`.
pub fn soft_cross_entropy(
    be: &CudaBackend,
    logits: &CudaTensor,
    targets: &CudaView<'_, f32>,
    scale: GradScale<'_>,
) -> CudaResult<XentOutput> {
    let (n, classes) = xent_shape(logits)?;
    same_len("soft_cross_entropy", "targets", n * classes, targets.len())?;
    xent_launch(be, logits, XentTarget::Soft(targets), 0.0, None, scale)
}

fn xent_shape(logits: &CudaTensor) -> CudaResult<(usize, usize)> {
    match *logits.shape() {
        [n, k] if n > 0 && k > 0 => Ok((n, k)),
        _ => Err(CudaError::shape(
            "cross_entropy",
            "logits [n, classes] with n ≥ 1 and classes ≥ 1",
            format!("{:?}", logits.shape()),
        )),
    }
}

/// What the cross-entropy is taken against.
enum XentTarget<'a, 'v> {
    Labels(&'a CudaView<'v, u32>),
    Soft(&'a CudaView<'v, f32>),
}

/// Launches one of the cross-entropy kernels, or with `focal` (its γ) one
/// of the focal-loss kernels: (params, loss scale, logits, labels or soft
/// targets, row_loss, row_correct, grad). One warp per row, 8 rows per
/// block.
fn xent_launch(
    be: &CudaBackend,
    logits: &CudaTensor,
    target: XentTarget<'_, '_>,
    smoothing: f32,
    focal: Option<f32>,
    scale: GradScale<'_>,
) -> CudaResult<XentOutput> {
    scale.check("cross_entropy")?;
    let pair = match (&target, focal) {
        (XentTarget::Labels(_), None) => k::SOFTMAX_XENT,
        (XentTarget::Soft(_), None) => k::SOFTMAX_XENT_SOFT,
        (XentTarget::Labels(_), Some(_)) => k::SOFTMAX_FOCAL,
        (XentTarget::Soft(_), Some(_)) => k::SOFTMAX_FOCAL_SOFT,
    };
    let sig = pair.of(logits.dtype());
    let (n, classes) = xent_shape(logits)?;
    let mut grad = CudaTensor::uninit(be, logits.shape(), logits.dtype())?;
    let mut row_loss = be.alloc::<f32>(n)?;
    let mut row_correct = be.alloc::<u32>(n)?;
    let p = XentParams {
        rows: u32_of("cross_entropy", n)?,
        classes: u32_of("cross_entropy", classes)?,
        smoothing,
        share: scale.share,
    };
    let focal_params = focal.map(|gamma| FocalParams {
        rows: p.rows,
        classes: p.classes,
        smoothing,
        share: scale.share,
        gamma,
    });
    let threads = u32_of("cross_entropy", n * 32)? as usize;
    let cfg = LaunchConfig {
        grid_dim: (threads.div_ceil(BLOCK as usize) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    {
        let f = be.function(sig)?;
        // SAFETY: softmax_xent_T(XentParams, const float* loss_scale [1],
        // const T* logits [n, k], const u32* labels [n], ...) and
        // softmax_xent_soft_T(..., const float* targets [n, k], ...), then
        // float* row_loss [n], u32* row_correct [n], T* grad [n, k]; the
        // focal kernels alike with FocalParams; the callers checked the
        // target's length.
        unsafe {
            launch(be.compute_stream(), &f, cfg, sig.name, |b| {
                match &focal_params {
                    Some(focal) => b.arg(focal),
                    None => b.arg(&p),
                };
                b.arg(scale.loss_scale).arg(logits);
                match target {
                    XentTarget::Labels(labels) => b.arg(labels),
                    XentTarget::Soft(targets) => b.arg(targets),
                };
                b.arg(&mut row_loss.slice)
                    .arg(&mut row_correct.slice)
                    .arg(&mut grad);
            })
        }?;
    }
    Ok(XentOutput {
        grad,
        row_loss,
        row_correct,
    })
}

/// Uploads class labels after checking each is below `classes`.
pub fn upload_labels(
    be: &CudaBackend,
    labels: &[u32],
    classes: usize,
) -> CudaResult<DeviceBuffer<u32>> {
    if let Some((i, &bad)) = labels
        .iter()
        .enumerate()
        .find(|(_, &l)| l as usize >= classes)
    {
        return Err(CudaError::shape(
            "cross_entropy",
            format!("labels below the class count {classes}"),
            format!("label {bad} at sample {i}"),
        ));
    }
    be.upload(labels)
}
