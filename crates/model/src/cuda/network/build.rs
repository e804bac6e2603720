//! Building the GPU layers of a network: the one builder of both devices
//! (`crate::network`) declares each spec entry's layers as CPU `Layer`s,
//! and each is asked for its GPU form (`Layer::to_cuda`, implemented beside
//! its GPU struct in its op family's folder). This file holds only the walk:
//! the groups in spec order (what `model.checkpoint` segments), and the
//! refusal of a layer without a CUDA form.
//!
//! The declarations are built unfused (the GPU fuses its own layers after
//! arranging them, `layer::fuse`), one entry at a time in a private memory
//! pool, with a throwaway initialisation: the weights are the CPU
//! network's, copied in by parameter order (`ParamCursor`), so an entry's
//! declaration is dropped as soon as it is converted.

use crate::cuda::containers::CheckpointedLayer;
use crate::cuda::{CudaError, CudaResult};
use crate::network::{is_block, Group};
use crate::{Layer, LayerSpec};

use super::*;

/// A built layer and its floor.
pub(super) type Floored = (Floor, Box<dyn CudaLayer>);

/// One group per spec entry, in order (unfused), each layer with its
/// floor: where the parameter cursor stood in each group when the layer
/// took its first parameter (every parameter of it and of the layers after
/// it lies at or above).
pub(super) fn build_groups(
    be: &CudaBackend,
    cpu: &Network,
    cursor: &mut ParamCursor<'_>,
) -> crate::Result<Vec<Group<Floored>>> {
    let mut groups = Vec::new();
    let declarations = MemoryPool::new(Device::Cpu);
    declarations.scope(|| {
        crate::network::for_each_declared_entry(
            cpu.spec(),
            cpu.registry(),
            |spec: &LayerSpec, path: &str, input: &[usize], layers: Vec<Box<dyn Layer>>| {
                let built = convert_all_floored(be, cursor, path, input, &layers)?;
                groups.push(Group {
                    block: is_block(spec),
                    layers: built,
                });
                Ok(())
            },
        )
    })?;
    Ok(groups)
}

/// A checkpointed segment of the GPU network (`arrange`'s wrapper).
pub(super) fn checkpointed(layers: Vec<Box<dyn CudaLayer>>) -> Box<dyn CudaLayer> {
    Box::new(CheckpointedLayer(layers))
}

/// The GPU forms of `layers`, in order, the first taking `input` (as the
/// CPU sees it), each taking its parameters' places in turn.
pub(super) fn convert_all(
    be: &CudaBackend,
    cursor: &mut ParamCursor<'_>,
    path: &str,
    input: &[usize],
    layers: &[Box<dyn Layer>],
) -> CudaResult<Vec<Box<dyn CudaLayer>>> {
    let floored = convert_all_floored(be, cursor, path, input, layers)?;
    Ok(floored.into_iter().map(|(_, layer)| layer).collect())
}

/// `convert_all`, each layer with its floor (`build_groups`).
fn convert_all_floored(
    be: &CudaBackend,
    cursor: &mut ParamCursor<'_>,
    path: &str,
    input: &[usize],
    layers: &[Box<dyn Layer>],
) -> CudaResult<Vec<Floored>> {
    let mut shape = input.to_vec();
    let mut out = Vec::with_capacity(layers.len());
    for layer in layers {
        let floor = cursor.offsets;
        out.push((floor, convert(be, cursor, path, &shape, layer.as_ref())?));
        shape = layer
            .output_shape(&shape)
            .map_err(|e| build_error(format!("{path}: its output shape"), e.to_string()))?;
    }
    Ok(out)
}

/// The GPU form of `layer` (at `path`, per-sample input `shape` as the CPU
/// sees it), or an error naming it when it has none.
pub(super) fn convert(
    be: &CudaBackend,
    cursor: &mut ParamCursor<'_>,
    path: &str,
    shape: &[usize],
    layer: &dyn Layer,
) -> CudaResult<Box<dyn CudaLayer>> {
    let mut ctx = CudaBuildContext {
        be,
        cursor,
        path,
        shape,
    };
    layer.to_cuda(&mut ctx).unwrap_or_else(|| {
        Err(CudaError::Unsupported {
            op: "CudaNetwork::build",
            reason: format!(
                "{path}: the layer \"{}\" has no CUDA implementation; \
                 train it with device.kind = \"cpu\"",
                layer.describe()
            ),
        })
    })
}

pub(crate) fn build_error(what: String, got: String) -> CudaError {
    CudaError::shape("CudaNetwork::build", what, got)
}
