//! stub
use crate::{Result, Tensor};
pub struct LossOutput {
    pub loss: f32,
    pub grad: Tensor,
    pub correct: usize,
}
pub fn softmax_cross_entropy(
    logits: &Tensor,
    _labels: &[u32],
    _smoothing: f32,
) -> Result<LossOutput> {
    Ok(LossOutput {
        loss: 0.0,
        grad: logits.clone(),
        correct: 0,
    })
}
