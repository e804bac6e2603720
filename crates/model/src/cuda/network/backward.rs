//! The backward walk: each layer's backward (`CudaLayer::backward`) in
//! reverse, down to the network's first layer with parameters.

use crate::cuda::backend::CudaBackend;
use crate::cuda::layer::{dims, CudaLayer, Groups, Saved};
use crate::cuda::network::Floor;
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

/// `backward_network`, calling `after_layer` after each top-level layer
/// with the lowest floor of the layers passed (`CudaNetwork::backward_with`);
/// the last call's floor covers every gradient.
pub fn backward_network_with(
    be: &CudaBackend,
    layers: &mut [Box<dyn CudaLayer>],
    floors: &[Floor],
    groups: &mut Groups,
    saved: &mut Vec<Saved>,
    mut g: CudaTensor,
    after_layer: &mut dyn FnMut(&mut Groups, &Floor) -> CudaResult<()>,
) -> CudaResult<()> {
    if floors.len() != layers.len() {
        return Err(crate::cuda::CudaError::shape(
            "backward_network_with",
            format!("a floor per layer ({})", layers.len()),
            floors.len().to_string(),
        ));
    }
    let Some(first) = layers.iter().position(|l| l.may_have_params()) else {
        return after_layer(groups, &[0; 3]);
    };
    let mut lowest = [usize::MAX; 3];
    for i in (first..layers.len()).rev() {
        let out = dims(&g);
        let layer = &mut layers[i];
        if i == first {
            layer.backward_params_only(be, groups, saved, g)?;
            be.profile_mark(|| format!("bwd {} out {out}", layer.describe()))?;
            // Nothing before the first layer with parameters has any.
            return after_layer(groups, &[0; 3]);
        }
        g = layer.backward(be, groups, saved, g)?;
        be.profile_mark(|| format!("bwd {} out {out}", layer.describe()))?;
        for (low, floor) in lowest.iter_mut().zip(&floors[i]) {
            *low = (*low).min(*floor);
        }
        after_layer(groups, &lowest)?;
    }
    Ok(())
}
