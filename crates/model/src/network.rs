//! The network: a sequence of layers built from the experiment's `[model]`
//! table, so an architecture changes without code. A forward runs the layers
//! in order; backward runs them in reverse, each adding into its parameters'
//! gradients.

use serde::{Deserialize, Serialize};

use crate::init::InitRng;
use crate::layers::{BatchNorm2d, Conv2d, GlobalAvgPool, Linear, Relu, Residual};
use crate::{Layer, Mode, ModelError, Param, Result, Tensor};

/// `[model]` in an experiment file.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Per-sample input shape, NHWC without N: [height, width, channels].
    pub input: [usize; 3],
    /// Input normalisation applied to u8 pixels: (x/255 - mean) / std.
    pub mean: f32,
    pub std: f32,
    pub layers: Vec<LayerSpec>,
}

fn default_kernel() -> usize {
    3
}
fn default_stride() -> usize {
    1
}
fn default_true() -> bool {
    true
}
fn default_momentum() -> f32 {
    0.1
}
fn default_eps() -> f32 {
    1e-5
}

/// One entry of `model.layers`, tagged by `type`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum LayerSpec {
    /// Convolution; `padding` defaults to kernel/2 ("same" at stride 1).
    Conv {
        out: usize,
        #[serde(default = "default_kernel")]
        kernel: usize,
        #[serde(default = "default_stride")]
        stride: usize,
        #[serde(default)]
        padding: Option<usize>,
        #[serde(default)]
        bias: bool,
    },
    BatchNorm {
        #[serde(default = "default_momentum")]
        momentum: f32,
        #[serde(default = "default_eps")]
        eps: f32,
    },
    Relu,
    /// `layers(x) + x`; the body must keep the shape.
    Residual {
        layers: Vec<LayerSpec>,
    },
    /// The reference ResNet block: conv3x3+BN+ReLU, conv3x3+BN, add the
    /// block's input, ReLU. Its width is its input's.
    BasicBlock,
    GlobalAvgPool,
    Linear {
        out: usize,
        #[serde(default = "default_true")]
        bias: bool,
    },
}

pub struct Network {
    spec: ModelSpec,
    layers: Vec<Box<dyn Layer>>,
    output_shape: Vec<usize>,
}

impl Network {
    /// Builds and initialises the network; errors name the layer
    /// (`model.layers[3]`) and what does not fit.
    pub fn build(spec: &ModelSpec, seed: u64) -> Result<Self> {
        if spec.input.contains(&0) {
            return Err(ModelError::Spec {
                path: "model.input".into(),
                reason: format!("every dimension must be positive, got {:?}", spec.input),
            });
        }
        if !(spec.std.is_finite() && spec.std > 0.0 && spec.mean.is_finite()) {
            return Err(ModelError::Spec {
                path: "model.std".into(),
                reason: format!(
                    "need a finite mean and a positive std, got mean {} std {}",
                    spec.mean, spec.std
                ),
            });
        }
        let mut rng = InitRng::new(seed);
        let mut shape = spec.input.to_vec();
        let layers = build_layers(&spec.layers, "model.layers", &mut shape, &mut rng)?;
        if shape.len() != 1 {
            return Err(ModelError::Spec {
                path: "model.layers".into(),
                reason: format!(
                    "the network must end in class scores [classes], it ends in {shape:?}"
                ),
            });
        }
        Ok(Self {
            spec: spec.clone(),
            layers,
            output_shape: shape,
        })
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    pub fn num_classes(&self) -> usize {
        self.output_shape[0]
    }

    /// Converts a u8 NHWC batch into the normalised input tensor.
    pub fn input_from_u8(&self, batch: usize, pixels: &[u8]) -> Result<Tensor> {
        let [h, w, c] = self.spec.input;
        Tensor::from_u8_normalized(&[batch, h, w, c], pixels, self.spec.mean, self.spec.std)
    }

    /// Returns the logits, [N, classes].
    pub fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        let [h, w, c] = self.spec.input;
        input.expect_shape("network input", &[input.batch(), h, w, c])?;
        let mut x = input.clone();
        for layer in &mut self.layers {
            x = layer.forward(&x, mode)?;
        }
        Ok(x)
    }

    /// Adds parameter gradients for `grad_logits` = dLoss/dlogits.
    pub fn backward(&mut self, grad_logits: &Tensor) -> Result<()> {
        let mut g = grad_logits.clone();
        for layer in self.layers.iter_mut().rev() {
            g = layer.backward(&g)?;
        }
        Ok(())
    }

    pub fn params_mut(&mut self) -> Vec<&mut Param> {
        self.layers
            .iter_mut()
            .flat_map(|l| l.params_mut())
            .collect()
    }

    pub fn buffers_mut(&mut self) -> Vec<&mut Tensor> {
        self.layers
            .iter_mut()
            .flat_map(|l| l.buffers_mut())
            .collect()
    }

    pub fn zero_grad(&mut self) {
        for p in self.params_mut() {
            p.zero_grad();
        }
    }

    pub fn clear_saved(&mut self) {
        for layer in &mut self.layers {
            layer.clear_saved();
        }
    }

    pub fn num_params(&mut self) -> usize {
        self.params_mut().iter().map(|p| p.value.len()).sum()
    }

    /// Multiply-adds of one sample's forward.
    pub fn macs_per_sample(&self) -> Result<u64> {
        let mut shape = self.spec.input.to_vec();
        let mut total = 0;
        for layer in &self.layers {
            total += layer.macs(&shape)?;
            shape = layer.output_shape(&shape)?;
        }
        Ok(total)
    }

    /// One line per layer: what it is and its output shape.
    pub fn summary(&self) -> Result<Vec<String>> {
        let mut shape = self.spec.input.to_vec();
        let mut lines = Vec::new();
        for layer in &self.layers {
            shape = layer.output_shape(&shape)?;
            lines.push(format!("{:<28} -> {:?}", layer.describe(), shape));
        }
        Ok(lines)
    }
}

fn build_layers(
    specs: &[LayerSpec],
    path: &str,
    shape: &mut Vec<usize>,
    rng: &mut InitRng,
) -> Result<Vec<Box<dyn Layer>>> {
    let mut layers = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        let here = format!("{path}[{i}]");
        for layer in build_one(spec, &here, shape, rng)? {
            *shape = layer.output_shape(shape).map_err(|e| ModelError::Spec {
                path: here.clone(),
                reason: e.to_string(),
            })?;
            layers.push(layer);
        }
    }
    Ok(layers)
}

fn spec_error(path: &str, reason: impl Into<String>) -> ModelError {
    ModelError::Spec {
        path: path.to_string(),
        reason: reason.into(),
    }
}

fn image_channels(path: &str, shape: &[usize]) -> Result<usize> {
    match shape {
        [_, _, c] => Ok(*c),
        _ => Err(spec_error(
            path,
            format!("needs an image input [h, w, c], got {shape:?}"),
        )),
    }
}

fn build_one(
    spec: &LayerSpec,
    path: &str,
    shape: &[usize],
    rng: &mut InitRng,
) -> Result<Vec<Box<dyn Layer>>> {
    let built: Vec<Box<dyn Layer>> = match spec {
        LayerSpec::Conv {
            out,
            kernel,
            stride,
            padding,
            bias,
        } => {
            let cin = image_channels(path, shape)?;
            if *out == 0 || *kernel == 0 || *stride == 0 {
                return Err(spec_error(path, "out, kernel and stride must be positive"));
            }
            let pad = padding.unwrap_or(kernel / 2);
            vec![Box::new(Conv2d::new(
                path, cin, *out, *kernel, *stride, pad, *bias, rng,
            )?)]
        }
        LayerSpec::BatchNorm { momentum, eps } => {
            let c = image_channels(path, shape)?;
            if !(0.0..=1.0).contains(momentum) || eps.is_nan() || *eps <= 0.0 {
                return Err(spec_error(
                    path,
                    "momentum must be in [0, 1] and eps positive",
                ));
            }
            vec![Box::new(BatchNorm2d::new(path, c, *momentum, *eps))]
        }
        LayerSpec::Relu => vec![Box::new(Relu::new())],
        LayerSpec::GlobalAvgPool => {
            image_channels(path, shape)?;
            vec![Box::new(GlobalAvgPool::new())]
        }
        LayerSpec::Linear { out, bias } => {
            let [features] = shape else {
                return Err(spec_error(
                    path,
                    format!(
                        "linear needs a feature vector [c], got {shape:?}; add a global_avg_pool"
                    ),
                ));
            };
            if *out == 0 {
                return Err(spec_error(path, "out must be positive"));
            }
            vec![Box::new(Linear::new(path, *features, *out, *bias, rng))]
        }
        LayerSpec::Residual { layers } => {
            let mut inner = shape.to_vec();
            let body = build_layers(layers, &format!("{path}.layers"), &mut inner, rng)?;
            if inner != shape {
                return Err(spec_error(
                    path,
                    format!("residual body maps {shape:?} to {inner:?}; it must keep the shape"),
                ));
            }
            vec![Box::new(Residual::new(body))]
        }
        LayerSpec::BasicBlock => {
            let c = image_channels(path, shape)?;
            let conv = LayerSpec::Conv {
                out: c,
                kernel: 3,
                stride: 1,
                padding: None,
                bias: false,
            };
            let bn = LayerSpec::BatchNorm {
                momentum: default_momentum(),
                eps: default_eps(),
            };
            let body = vec![conv.clone(), bn.clone(), LayerSpec::Relu, conv, bn];
            let mut built = build_one(&LayerSpec::Residual { layers: body }, path, shape, rng)?;
            built.push(Box::new(Relu::new()));
            built
        }
    };
    Ok(built)
}
