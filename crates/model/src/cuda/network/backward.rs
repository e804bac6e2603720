//! The backward walk: each layer's backward (`CudaLayer::backward`) in
//! reverse, down to the network's first layer with parameters.

use crate::cuda::backend::CudaBackend;
use crate::cuda::layer::{dims, CudaLayer, Groups, Saved};
use crate::cuda::tensor::CudaTensor;
use crate::cuda::CudaResult;

/// Runs `layers` backward from the output gradient `g`: the input
/// gradient; each layer pops what its forward pushed.
pub fn backward_list(
    be: &CudaBackend,
    layers: &mut [Box<dyn CudaLayer>],
    groups: &mut Groups,
    saved: &mut Vec<Saved>,
    mut g: CudaTensor,
) -> CudaResult<CudaTensor> {
    for layer in layers.iter_mut().rev() {
        let out = dims(&g);
        g = layer.backward(be, groups, saved, g)?;
        be.profile_mark(|| format!("bwd {} out {out}", layer.describe()))?;
    }
    Ok(g)
}

/// The network's backward, down to its first layer with parameters (what
/// the layers before it saved is dropped unused).
pub fn backward_network(
    be: &CudaBackend,
    layers: &mut [Box<dyn CudaLayer>],
    groups: &mut Groups,
    saved: &mut Vec<Saved>,
    mut g: CudaTensor,
) -> CudaResult<()> {
    let Some(first) = layers.iter().position(|l| l.may_have_params()) else {
        return Ok(());
    };
    let Some((first, after)) = layers[first..].split_first_mut() else {
        return Ok(());
    };
    g = backward_list(be, after, groups, saved, g)?;
    let out = dims(&g);
    first.backward_params_only(be, groups, saved, g)?;
    be.profile_mark(|| format!("bwd {} out {out}", first.describe()))
}
