//! The network builder through the public API: the reference ResNet read
//! from TOML, its size and cost, spec errors, and a small network that
//! learns.

use headroom_model::loss::softmax_cross_entropy;
use headroom_model::{BuildOptions, Mode, ModelError, ModelSpec, Network, Tensor};
mod common;

use common::{parse, REFERENCE};

/// A spec with the reference header and the given `layers` entries.
fn with_layers(layers: &str) -> String {
    format!("[model]\ninput = [28, 28, 1]\nmean = 0.5\nstd = 0.5\nlayers = [\n{layers}\n]\n")
}

/// Parameters and multiply-adds of the reference net, counted by hand:
/// 3×3 convolutions without bias, a batch norm (γ, β) after every one, and
/// a basic block = two 3×3 convolutions (c -> c) each followed by a BN.
fn reference_counts() -> (usize, u64) {
    let conv_params = |cin: usize, cout: usize| 3 * 3 * cin * cout;
    let bn_params = |c: usize| 2 * c;
    let conv_macs = |hw: usize, cin: usize, cout: usize| (hw * hw * cout * 9 * cin) as u64;
    let mut params = 0;
    let mut macs = 0;
    // (input channels, width, output spatial size) of each stage's stem conv.
    for (cin, c, hw) in [(1, 32, 28), (32, 64, 14), (64, 128, 7)] {
        params += conv_params(cin, c) + bn_params(c);
        params += 2 * (conv_params(c, c) + bn_params(c));
        macs += conv_macs(hw, cin, c) + 2 * conv_macs(hw, c, c);
    }
    params += 128 * 10 + 10;
    macs += 128 * 10;
    (params, macs)
}

#[test]
fn reference_resnet_has_the_expected_size_and_cost() {
    let spec = parse(REFERENCE).expect("the reference spec parses");
    assert_eq!(spec.input, [28, 28, 1]);
    assert_eq!(spec.layers.len(), 14);
    let mut net = Network::build(&spec, 0).expect("the reference spec builds");
    assert_eq!(net.num_classes(), 10);

    let (params, macs) = reference_counts();
    assert_eq!(params, 482_154);
    assert_eq!(macs, 50_804_480);
    assert_eq!(net.num_params(), params);
    assert_eq!(net.macs_per_sample().unwrap(), macs);

    // Parameter names lead back to the spec; decay only on weights.
    let names: Vec<(String, bool)> = net
        .params_mut()
        .iter()
        .map(|p| (p.name.clone(), p.decay))
        .collect();
    assert!(names.contains(&("model.layers[1].gamma".to_string(), false)));
    assert!(names.contains(&("model.layers[13].weight".to_string(), true)));
    assert!(names.contains(&("model.layers[13].bias".to_string(), false)));
    // One running mean and one running variance per batch norm: 3 stems + 6
    // in the blocks.
    assert_eq!(net.buffers_mut().len(), 2 * 9);

    let summary = net.summary().unwrap();
    // Fused (the default): each stem is conv + bn+relu, each basic block one
    // layer; unfused, a block is a residual + a relu.
    assert_eq!(summary.len(), 11, "{summary:#?}");
    let unfused = Network::build_with(&spec, 0, BuildOptions { fuse: false })
        .expect("the reference spec builds")
        .summary()
        .unwrap();
    assert_eq!(unfused.len(), 17, "{unfused:#?}");
    assert!(summary.last().unwrap().contains("[10]"), "{summary:?}");
}

#[test]
fn the_same_seed_builds_the_same_network() {
    let spec = parse(REFERENCE).unwrap();
    let weights = |seed| -> Vec<Vec<f32>> {
        Network::build(&spec, seed)
            .unwrap()
            .params_mut()
            .iter()
            .map(|p| p.value.data().to_vec())
            .collect()
    };
    assert_eq!(weights(0), weights(0));
    assert_ne!(weights(0), weights(1));
}

#[test]
fn an_unknown_key_inside_a_layer_is_a_parse_error_naming_it() {
    let err = parse(&with_layers(r#"{ type = "conv", out = 32, strid = 2 }"#))
        .expect_err("a misspelt key must not parse");
    assert!(err.to_string().contains("strid"), "{err}");
}

#[test]
fn an_unknown_layer_type_is_a_parse_error_naming_it() {
    let err = parse(&with_layers(r#"{ type = "convolution", out = 32 }"#))
        .expect_err("an unknown layer type must not parse");
    assert!(err.to_string().contains("convolution"), "{err}");
}

#[test]
fn a_linear_after_a_conv_is_a_spec_error_naming_the_layer() {
    let spec = parse(&with_layers(
        r#"{ type = "conv", out = 8 }, { type = "linear", out = 10 }"#,
    ))
    .unwrap();
    let err = Network::build(&spec, 0).err().expect("must not build");
    assert!(matches!(err, ModelError::Spec { .. }), "{err:?}");
    assert!(err.to_string().contains("model.layers["), "{err}");
    assert!(err.to_string().contains("model.layers[1]"), "{err}");
}

/// `max_pool`: the stride defaults to the kernel, the output side is
/// ⌊(side − kernel)/stride⌋ + 1, and a kernel wider than the image (there is
/// no padding) or a zero kernel is a spec error naming the layer; frames
/// pool frame by frame.
#[test]
fn max_pool_shapes_and_spec_errors() {
    let build = |layers: &str| Network::build(&parse(&with_layers(layers)).unwrap(), 0);
    // What reaches the classifier: its weight is [features, 2].
    let features = |layers: &str| {
        let mut net = build(&format!(
            r#"{layers}, {{ type = "flatten" }}, {{ type = "linear", out = 2, bias = false }}"#
        ))
        .unwrap();
        net.params_mut().last().unwrap().value.len() / 2
    };
    assert_eq!(features(r#"{ type = "max_pool", kernel = 2 }"#), 14 * 14);
    let layers = r#"{ type = "max_pool", kernel = 3, stride = 2 }"#;
    assert_eq!(features(layers), 13 * 13);
    let layers =
        r#"{ type = "conv", out = 4, padding = 0 }, { type = "max_pool", kernel = 5, stride = 5 }"#;
    assert_eq!(features(layers), 5 * 5 * 4);
    for (layers, says) in [
        (
            r#"{ type = "max_pool", kernel = 4 }, { type = "max_pool", kernel = 8 }"#,
            "does not fit the 7x7 image",
        ),
        (
            r#"{ type = "relu" }, { type = "max_pool", kernel = 0 }"#,
            "positive",
        ),
        (
            r#"{ type = "relu" }, { type = "max_pool", kernel = 2, stride = 0 }"#,
            "positive",
        ),
        (
            r#"{ type = "global_avg_pool" }, { type = "max_pool", kernel = 2 }"#,
            "image input",
        ),
    ] {
        let err = build(layers).err().expect("must not build");
        assert!(matches!(err, ModelError::Spec { .. }), "{err:?}");
        assert!(err.to_string().contains("model.layers[1]"), "{err}");
        assert!(err.to_string().contains(says), "{err}");
    }
    let frames = "[model]\ninput = [6, 6, 2]\nmean = 0.5\nstd = 0.5\nframes = 3\nlayers = [\n\
        { type = \"max_pool\", kernel = 2 }, { type = \"upsample2x\" }\n]\n";
    let mut net = Network::build(&parse(frames).unwrap(), 0).unwrap();
    assert_eq!(net.output_shape(), &[3, 6, 6, 2]);
    let x = Tensor::from_vec(&[1, 3, 6, 6, 2], (0..216).map(|v| v as f32).collect()).unwrap();
    let y = net.forward(&x, Mode::Eval).unwrap();
    // Values grow along the frame: each 2x2 window's largest is its last.
    assert_eq!(y.data()[..2], [14.0, 15.0]);
    assert_eq!(y.data()[72..74], [86.0, 87.0]);
}

/// `depthwise_conv`: the defaults (3×3, stride 1, "same" padding, no bias,
/// multiplier 1), its weight [k, k, c·multiplier] and bias [c·multiplier]
/// named after the layer, its output size, and spec errors naming the layer.
#[test]
fn depthwise_conv_shapes_params_and_spec_errors() {
    let build = |layers: &str| Network::build(&parse(&with_layers(layers)).unwrap(), 0);
    let head = r#"{ type = "global_avg_pool" }, { type = "linear", out = 2 }"#;
    let layers = format!(
        r#"{{ type = "conv", out = 3 }}, {{ type = "depthwise_conv" }},
           {{ type = "depthwise_conv", kernel = 5, stride = 2, multiplier = 2, bias = true }},
           {head}"#
    );
    let mut net = build(&layers).unwrap();
    let params: Vec<(String, Vec<usize>)> = net
        .params_mut()
        .iter()
        .map(|p| (p.name.clone(), p.value.shape().to_vec()))
        .collect();
    assert_eq!(params[1], ("model.layers[1].weight".into(), vec![3, 3, 3]));
    assert_eq!(params[2], ("model.layers[2].weight".into(), vec![5, 5, 6]));
    assert_eq!(params[3], ("model.layers[2].bias".into(), vec![6]));
    // The linear layer reads 6 channels.
    assert_eq!(params[4].1, vec![6, 2]);
    for (layer, says) in [
        (r#"{ type = "depthwise_conv", multiplier = 0 }"#, "positive"),
        (r#"{ type = "depthwise_conv", stride = 0 }"#, "positive"),
        (
            r#"{ type = "depthwise_conv", kernel = 9, padding = 0 }"#,
            "at least 9x9",
        ),
    ] {
        let err = build(&format!(
            r#"{{ type = "max_pool", kernel = 4 }}, {layer}, {head}"#
        ))
        .err()
        .expect("must not build");
        assert!(matches!(err, ModelError::Spec { .. }), "{err:?}");
        assert!(err.to_string().contains("model.layers[1]"), "{err}");
        assert!(err.to_string().contains(says), "{err}");
    }
    let frames = "[model]\ninput = [6, 6, 2]\nmean = 0.5\nstd = 0.5\nframes = 3\nlayers = [\n\
        { type = \"depthwise_conv\" }\n]\n";
    let mut net = Network::build(&parse(frames).unwrap(), 0).unwrap();
    assert_eq!(net.output_shape(), &[3, 6, 6, 2]);
    let x = Tensor::from_vec(&[2, 3, 6, 6, 2], vec![1.0; 432]).unwrap();
    assert_eq!(
        net.forward(&x, Mode::Train).unwrap().shape(),
        &[2, 3, 6, 6, 2]
    );
}

/// A small residual net on 8×8 inputs, small enough to train in a test.
fn small_spec() -> ModelSpec {
    parse(
        r#"
[model]
input = [8, 8, 1]
mean = 0.5
std = 0.25
layers = [
  { type = "conv", out = 8 }, { type = "batch_norm" }, { type = "relu" },
  { type = "basic_block" },
  { type = "conv", out = 16, stride = 2 }, { type = "batch_norm" }, { type = "relu" },
  { type = "global_avg_pool" },
  { type = "linear", out = 4 },
]
"#,
    )
    .unwrap()
}

/// 16 images: class = quadrant of a bright 3×3 blob on a dark background.
fn blobs() -> (Vec<u8>, Vec<u32>) {
    let mut pixels = vec![20u8; 16 * 64];
    let mut labels = Vec::new();
    for i in 0..16 {
        let class = i % 4;
        let (oy, ox) = [(0, 0), (0, 4), (4, 0), (4, 4)][class];
        let (dy, dx) = ((i / 4) % 2, i / 8);
        for y in 0..3 {
            for x in 0..3 {
                pixels[i * 64 + (oy + dy + y) * 8 + (ox + dx + x)] = 230;
            }
        }
        labels.push(class as u32);
    }
    (pixels, labels)
}

#[test]
fn a_small_network_learns_a_fixed_batch() {
    let spec = small_spec();
    let mut net = Network::build(&spec, 7).unwrap();
    let (pixels, labels) = blobs();
    let x = net.input_from_u8(16, &pixels).unwrap();
    assert_eq!(x.shape(), &[16, 8, 8, 1]);

    let mut first = None;
    let mut last = f32::NAN;
    for _ in 0..60 {
        net.zero_grad();
        let logits = net.forward(&x, Mode::Train).unwrap();
        assert_eq!(logits.shape(), &[16, 4]);
        let out = softmax_cross_entropy(&logits, &labels, 0.0).unwrap();
        assert!(out.loss.is_finite());
        first.get_or_insert(out.loss);
        last = out.loss;
        net.backward(&out.grad).unwrap();
        for p in net.params_mut() {
            let grad = p.grad.data().to_vec();
            for (w, g) in p.value.data_mut().iter_mut().zip(grad) {
                *w -= 0.3 * g;
            }
        }
    }
    let first = first.unwrap();
    assert!(
        last < 0.1 * first,
        "loss went from {first} to {last}: the network does not learn"
    );
    // After training, evaluation (running statistics) classifies the batch.
    let logits = net.forward(&x, Mode::Eval).unwrap();
    let out = softmax_cross_entropy(&logits, &labels, 0.0).unwrap();
    assert!(
        out.correct >= 12,
        "{} of 16 correct in eval mode",
        out.correct
    );
}

#[test]
fn backward_accumulates_and_needs_a_training_forward() {
    let mut net = Network::build(&small_spec(), 3).unwrap();
    let (pixels, labels) = blobs();
    let x = net.input_from_u8(16, &pixels).unwrap();

    let grads = |net: &mut Network| -> Vec<Vec<f32>> {
        net.params_mut()
            .iter()
            .map(|p| p.grad.data().to_vec())
            .collect()
    };
    let step = |net: &mut Network, x: &Tensor| {
        let logits = net.forward(x, Mode::Train).unwrap();
        let out = softmax_cross_entropy(&logits, &labels, 0.1).unwrap();
        net.backward(&out.grad).unwrap();
    };
    net.zero_grad();
    step(&mut net, &x);
    let once = grads(&mut net);
    assert!(once.iter().flatten().any(|&g| g != 0.0));
    step(&mut net, &x);
    let twice = grads(&mut net);
    for (a, b) in once.iter().flatten().zip(twice.iter().flatten()) {
        assert!(
            (b - 2.0 * a).abs() <= 1e-4 * a.abs().max(1e-2),
            "{b} is not twice {a}"
        );
    }

    // Evaluation saves nothing, so a backward after it is an error.
    let logits = net.forward(&x, Mode::Eval).unwrap();
    let err = net.backward(&logits).unwrap_err();
    assert!(matches!(err, ModelError::NoSavedActivation { .. }), "{err}");
    // So does a backward after clear_saved.
    net.forward(&x, Mode::Train).unwrap();
    net.clear_saved();
    assert!(net.backward(&logits).is_err());
}

/// The loss of `labels` for `x`, batch statistics as in training.
fn training_loss(net: &mut Network, x: &Tensor, labels: &[u32]) -> f64 {
    let logits = net.forward(x, Mode::Train).unwrap();
    net.clear_saved();
    softmax_cross_entropy(&logits, labels, 0.0).unwrap().loss as f64
}

/// The first layer's weight gradient from `backward` agrees with central
/// differences of the loss: that layer's backward computes its parameters'
/// gradients without the input gradient no one wants.
fn assert_first_weights_match_differences(net: &mut Network, x: &Tensor, labels: &[u32]) {
    net.zero_grad();
    let logits = net.forward(x, Mode::Train).unwrap();
    let out = softmax_cross_entropy(&logits, labels, 0.0).unwrap();
    net.backward(&out.grad).unwrap();
    let analytic = net.params_mut()[0].grad.data().to_vec();
    assert!(analytic.iter().any(|&g| g != 0.0));
    // The 12 largest, where a wrong factor shows above the differences' noise.
    let mut largest: Vec<usize> = (0..analytic.len()).collect();
    largest.sort_by(|&a, &b| analytic[b].abs().total_cmp(&analytic[a].abs()));
    let eps = 1e-3f32;
    for &j in &largest[..12] {
        let nudge = |net: &mut Network, by: f32| net.params_mut()[0].value.data_mut()[j] += by;
        nudge(net, eps);
        let up = training_loss(net, x, labels);
        nudge(net, -2.0 * eps);
        let down = training_loss(net, x, labels);
        nudge(net, eps);
        let numeric = (up - down) / (2.0 * eps as f64);
        let got = analytic[j] as f64;
        assert!(
            (got - numeric).abs() <= 1e-4 + 0.03 * numeric.abs(),
            "weight {j}: backward {got}, central difference {numeric}"
        );
    }
}

#[test]
fn the_first_convolution_and_linear_layers_get_the_loss_gradient() {
    let mut net = Network::build(&small_spec(), 5).unwrap();
    let (pixels, labels) = blobs();
    let x = net.input_from_u8(16, &pixels).unwrap();
    assert_first_weights_match_differences(&mut net, &x, &labels);

    let mlp = parse(&with_layers(
        r#"{ type = "flatten" }, { type = "linear", out = 16 }, { type = "silu" }, { type = "linear", out = 4 },"#,
    ))
    .unwrap();
    let mut net = Network::build(&mlp, 5).unwrap();
    let pixels: Vec<u8> = (0..16 * 784).map(|i| (i * 37 % 251) as u8).collect();
    let x = net.input_from_u8(16, &pixels).unwrap();
    assert_first_weights_match_differences(&mut net, &x, &labels);
}
