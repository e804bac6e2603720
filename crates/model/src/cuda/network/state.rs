//! The network's state: reading and writing its parameters, gradients
//! and buffers in the CPU network's order, streamed or whole.

use cudarc::driver::CudaView;

use crate::cuda::backend::{CudaBackend, DeviceBuffer};
use crate::cuda::error::Context;
use crate::cuda::param_group::ParamGroup;
use crate::cuda::tensor::DType;
use crate::cuda::{CudaError, CudaResult};

use super::*;

impl CudaNetwork {
    /// Every parameter's f32 master values, in the CPU network's order.
    pub fn read_params(&self, be: &CudaBackend) -> CudaResult<Vec<Vec<f32>>> {
        let masters = [
            be.download(&self.groups[0].master.slice)?,
            be.download(&self.groups[1].master.slice)?,
            be.download(&self.groups[FROZEN].master.slice)?,
        ];
        Ok(self.split(&masters, true))
    }

    /// Every parameter's f32 gradient (times the loss scale backward was
    /// given), in the CPU network's order.
    /// A frozen parameter's is empty, as on the CPU.
    pub fn read_grads(&self, be: &CudaBackend) -> CudaResult<Vec<Vec<f32>>> {
        let grads = [
            be.download(&self.groups[0].grad.slice)?,
            be.download(&self.groups[1].grad.slice)?,
            Vec::new(),
        ];
        Ok(self.split(&grads, false))
    }

    /// One of the four lists a checkpoint holds, in the CPU network's
    /// order (a frozen parameter's moments empty, as on the CPU),
    /// downloaded tensor by tensor through `staging`, whose length sets the
    /// piece: no copy of the list is made. `visit` gets `List(count)`,
    /// then per tensor `Tensor(len)` and its values in `Values` pieces.
    pub fn stream_state<E: From<CudaError>>(
        &self,
        be: &CudaBackend,
        list: StateList,
        staging: &mut [f32],
        visit: &mut dyn FnMut(StatePiece<'_>) -> Result<(), E>,
    ) -> Result<(), E> {
        if staging.is_empty() {
            return Err(
                CudaError::shape("stream_state", "a staging buffer", "an empty one").into(),
            );
        }
        let mut tensors: Vec<CudaView<'_, f32>> = Vec::new();
        match list {
            StateList::Buffers => {
                let mut buffers = Vec::new();
                checkpointed_buffers(&self.layers, &mut buffers);
                tensors.extend(buffers.iter().map(|b| b.slice.as_view()));
            }
            StateList::Params | StateList::FirstMoments | StateList::SecondMoments => {
                for p in &self.params {
                    let group = &self.groups[p.at.group];
                    let array = match list {
                        StateList::FirstMoments => &group.first_moment.slice,
                        StateList::SecondMoments => &group.second_moment.slice,
                        _ => &group.master.slice,
                    };
                    let held = list == StateList::Params || p.at.trainable();
                    let range = if held { p.at.range() } else { 0..0 };
                    tensors.push(array.slice(range));
                }
            }
        }
        visit(StatePiece::List(tensors.len()))?;
        for tensor in &tensors {
            visit(StatePiece::Tensor(tensor.len()))?;
            let mut start = 0;
            while start < tensor.len() {
                let piece = (tensor.len() - start).min(staging.len());
                let host = &mut staging[..piece];
                be.download_into(&tensor.slice(start..start + piece), host)?;
                visit(StatePiece::Values(host))?;
                start += piece;
            }
        }
        Ok(())
    }

    /// Per-parameter values out of per-group ones; frozen parameters get
    /// theirs only when `frozen` says the frozen group has values.
    pub(super) fn split(&self, groups: &[Vec<f32>; 3], frozen: bool) -> Vec<Vec<f32>> {
        self.params
            .iter()
            .map(|p| match p.at.trainable() || frozen {
                true => groups[p.at.group][p.at.range()].to_vec(),
                false => Vec::new(),
            })
            .collect()
    }

    /// Per-group values out of per-parameter ones, in the CPU's order. A
    /// frozen parameter's moments are empty (or anything: they are not
    /// used); its values are required.
    pub(super) fn join(&self, what: &str, values: &[Vec<f32>]) -> Result<[Vec<f32>; 3], String> {
        if values.len() != self.params.len() {
            return Err(format!(
                "{} {what}, the model has {}",
                values.len(),
                self.params.len()
            ));
        }
        let moments = what.starts_with("moment");
        let mut host = [0, 1, FROZEN].map(|g| vec![0.0f32; self.groups[g].len()]);
        for (slot, v) in self.params.iter().zip(values) {
            if moments && !slot.at.trainable() {
                continue;
            }
            if v.len() != slot.at.len {
                return Err(format!(
                    "{} has {} values, the model expects {}",
                    slot.name,
                    v.len(),
                    slot.at.len
                ));
            }
            host[slot.at.group][slot.at.range()].copy_from_slice(v);
        }
        Ok(host)
    }

    /// The buffers a checkpoint keeps, in the CPU network's order: batch
    /// norm's running statistics (mean, var per layer) and dropout's
    /// counters.
    pub fn read_buffers(&self, be: &CudaBackend) -> CudaResult<Vec<Vec<f32>>> {
        let mut buffers = Vec::new();
        checkpointed_buffers(&self.layers, &mut buffers);
        buffers.into_iter().map(|b| be.download(&b.slice)).collect()
    }

    /// Whether a layer draws dropout masks (its counters are buffers).
    pub fn has_dropout(&mut self) -> bool {
        let mut found = false;
        let _ = for_each_step_buffers(&mut self.layers, &mut |buffers| {
            found |= matches!(buffers, StepBuffers::Dropout(_));
            Ok(())
        });
        found
    }

    /// Moves every dropout layer's counter `by` training forwards on (data
    /// parallel: rank r draws its masks r·M forwards ahead of one process's
    /// counter, and every rank's counter ends a step world·M on, as that
    /// process's does). Waits for the device.
    pub fn advance_dropout(&mut self, be: &CudaBackend, by: u64) -> CudaResult<()> {
        if by == 0 {
            return Ok(());
        }
        for_each_step_buffers(&mut self.layers, &mut |buffers| match buffers {
            StepBuffers::Running(_) => Ok(()),
            StepBuffers::Dropout(d) => {
                let mut limbs = be.download(&d.counter.slice)?;
                let counter = crate::ops::activation::dropout::counter_of_limbs(&limbs);
                crate::ops::activation::dropout::limbs_of_counter(
                    counter.wrapping_add(by),
                    &mut limbs,
                );
                copy_host(be, &limbs, &mut d.counter)?;
                be.synchronize()
            }
        })
    }

    /// Writes the buffers `read_buffers` gives, in its order (the ranks'
    /// mean of them, in a data-parallel run).
    pub fn write_buffers(&mut self, be: &CudaBackend, values: &[Vec<f32>]) -> CudaResult<()> {
        self.set_buffers(be, values)
    }

    pub(super) fn set_buffers(&mut self, be: &CudaBackend, values: &[Vec<f32>]) -> CudaResult<()> {
        let mut it = values.iter();
        let mut next = || {
            it.next().ok_or_else(|| {
                CudaError::shape("buffers", "one per statistic and counter", "too few")
            })
        };
        for_each_step_buffers(&mut self.layers, &mut |buffers| match buffers {
            StepBuffers::Running(r) => {
                copy_host(be, next()?, &mut r.mean)?;
                copy_host(be, next()?, &mut r.var)
            }
            StepBuffers::Dropout(d) => copy_host(be, next()?, &mut d.counter),
        })
    }

    /// Checks a state's shapes against the model without changing anything.
    pub fn check_state(
        &self,
        params: &[Vec<f32>],
        buffers: &[Vec<f32>],
        moments: &[Vec<f32>],
    ) -> Result<(), String> {
        self.join("parameter tensors", params)?;
        self.join("moment tensors", moments)?;
        let mut model_buffers = Vec::new();
        checkpointed_buffers(&self.layers, &mut model_buffers);
        let lens: Vec<usize> = model_buffers.iter().map(|b| b.len()).collect();
        if lens.len() != buffers.len() {
            return Err(format!(
                "{} buffers, the model has {}",
                buffers.len(),
                lens.len()
            ));
        }
        match lens.iter().zip(buffers).position(|(l, b)| *l != b.len()) {
            Some(i) => Err(format!(
                "buffer {i} has {} values, the model expects {}",
                buffers[i].len(),
                lens[i]
            )),
            None => Ok(()),
        }
    }

    /// Replaces masters (and any f16 copies), moments and running
    /// statistics; gradients are zeroed. Call `check_state` first.
    pub fn load_state(
        &mut self,
        be: &CudaBackend,
        params: &[Vec<f32>],
        buffers: &[Vec<f32>],
        moments: (&[Vec<f32>], &[Vec<f32>]),
    ) -> crate::Result<()> {
        let refuse = |reason: String| crate::ModelError::State(reason);
        let masters = self.join("parameter tensors", params).map_err(refuse)?;
        let first = self.join("moment tensors", moments.0).map_err(refuse)?;
        let second = self.join("moment tensors", moments.1).map_err(refuse)?;
        for (i, group) in self.groups.iter_mut().enumerate() {
            copy_host(be, &masters[i], &mut group.master)?;
            group.refresh_compute(be)?;
            if i != FROZEN {
                copy_host(be, &first[i], &mut group.first_moment)?;
                copy_host(be, &second[i], &mut group.second_moment)?;
                group.zero_grad(be)?;
            }
        }
        self.set_buffers(be, buffers)?;
        Ok(())
    }
}

/// A group of the given values; an empty group holds one unused zero, so
/// every group has device buffers (the optimizer leaves a zero with a zero
/// gradient at zero).
pub(super) fn group_from_host(
    be: &CudaBackend,
    decay: bool,
    values: Vec<f32>,
    compute: DType,
) -> CudaResult<ParamGroup> {
    if values.is_empty() {
        return ParamGroup::from_host(be, decay, &[0.0], compute);
    }
    ParamGroup::from_host(be, decay, &values, compute)
}

pub(super) fn copy_host(
    be: &CudaBackend,
    host: &[f32],
    dev: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    if host.len() > dev.len() {
        return Err(CudaError::shape(
            "copy to device",
            format!("at most {} values", dev.len()),
            host.len().to_string(),
        ));
    }
    if host.is_empty() {
        return Ok(());
    }
    be.compute_stream()
        .memcpy_htod(host, &mut dev.slice.slice_mut(..host.len()))
        .during("cuMemcpyHtoDAsync")
}

pub(super) fn for_each_step_buffers(
    layers: &mut [Box<dyn CudaLayer>],
    f: &mut dyn FnMut(StepBuffers<'_>) -> CudaResult<()>,
) -> CudaResult<()> {
    layers.iter_mut().try_for_each(|l| l.step_buffers(f))
}

/// The buffers a checkpoint keeps, in the CPU's order: each batch norm's
/// running mean and variance, each dropout's counter.
pub(super) fn checkpointed_buffers<'a>(
    layers: &'a [Box<dyn CudaLayer>],
    out: &mut Vec<&'a DeviceBuffer<f32>>,
) {
    layers.iter().for_each(|l| l.checkpointed_buffers(out));
}
