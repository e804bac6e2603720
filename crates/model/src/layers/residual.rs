use crate::{Layer, Mode, Result, Tensor};
pub struct Residual;
impl Residual {
    pub fn new(_body: Vec<Box<dyn Layer>>) -> Self {
        Self
    }
}
impl Layer for Residual {
    fn describe(&self) -> String {
        "stub".into()
    }
    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        Ok(input.to_vec())
    }
    fn macs(&self, _input: &[usize]) -> Result<u64> {
        Ok(0)
    }
    fn forward(&mut self, input: &Tensor, _mode: Mode) -> Result<Tensor> {
        Ok(input.clone())
    }
    fn backward(&mut self, g: &Tensor) -> Result<Tensor> {
        Ok(g.clone())
    }
}
