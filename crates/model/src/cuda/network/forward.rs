//! The forward walk: each layer's forward (`CudaLayer::forward`) in order,
//! and what it keeps for backward pushed onto the stack as one entry.

use std::sync::Arc;

use crate::cuda::backend::CudaBackend;
use crate::cuda::layer::{
    dims, CudaLayer, Groups, Input, Keep, Pass, Recomputable, Saved, SavedBatchNorm,
};
use crate::cuda::tensor::CudaTensor;
use crate::cuda::CudaResult;
use crate::profile;

use super::Activation;

/// Runs `layers` on `x`; in training (`saved` given) pushes one entry per
/// layer run (a layer that nests layers pushes theirs below its own).
pub fn forward_list(
    be: &CudaBackend,
    layers: &mut [Box<dyn CudaLayer>],
    groups: &Groups,
    x: Input<'_>,
    pass: Pass,
    mut saved: Option<&mut Vec<Saved>>,
) -> CudaResult<CudaTensor> {
    let mut current = x;
    for layer in layers.iter_mut() {
        if layer.eval_identity() && pass == Pass::Eval {
            // The identity in evaluation: the input itself.
            continue;
        }
        if layer.flattens() {
            let shape = current.tensor().shape().to_vec();
            if let Some(list) = saved.as_deref_mut() {
                list.push(Saved::Shape(shape.clone()));
            }
            current = current.flattened(be)?;
            be.profile_mark(|| format!("fwd flatten in {}", profile::dims(&shape)))?;
            continue;
        }
        let (y, keep) = layer.forward(be, groups, &current, pass, saved.as_deref_mut())?;
        be.profile_mark(|| format!("fwd {} in {}", layer.describe(), dims(current.tensor())))?;
        let y = Arc::new(y);
        let mut recomputable = None;
        if let Some(list) = saved.as_deref_mut() {
            list.push(match keep {
                Keep::Input => Saved::Input(current.for_backward(be)?),
                Keep::InputAnd(stats) => Saved::LayerNorm(current.for_backward(be)?, stats),
                Keep::Segment => Saved::Segment(current.for_backward(be)?, pass),
                Keep::Output => Saved::Output(Activation::Kept(Arc::clone(&y))),
                Keep::Recomputed(r) => {
                    recomputable = Some(Arc::clone(&r));
                    Saved::Output(Activation::Recomputed(r))
                }
                Keep::BatchNorm { fused_relu, stats } => {
                    let input = current.share(be)?;
                    // The next layer's input, if it keeps it: computed again
                    // from this one's input where recomputing.
                    if let (
                        true,
                        Pass::Train {
                            recompute: true, ..
                        },
                    ) = (fused_relu, pass)
                    {
                        recomputable = Some(Recomputable::new(
                            Arc::clone(&input),
                            Arc::clone(&stats),
                            None,
                        ));
                    }
                    Saved::BatchNorm(Box::new(SavedBatchNorm { input, stats }))
                }
                Keep::Other(s) => s,
                Keep::Lstm(kept) => Saved::Lstm(current.for_backward(be)?, Arc::clone(&y), kept),
                Keep::ConvLstm(kept) => {
                    Saved::ConvLstm(current.for_backward(be)?, Arc::clone(&y), kept)
                }
            });
        }
        current = Input::Shared(y, recomputable);
    }
    current.into_owned(be)
}
