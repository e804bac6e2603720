//! Parity tests of the token models' ops (`src/ops/sequence`).

use super::*;

/// The table gradient sums each id's rows in row order, as the CPU layer
/// does: f32 gradients give the host loop's bits. 40 columns leave the
/// second 32-column tile part-empty; 3·37 rows end part-way through a
/// 32-row ballot; id 0 fills most rows, id 5 none, and one id is out of
/// range (its row adds nowhere).
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn the_embedding_table_gradient_sums_rows_in_order() {
    let be = gpu_or_skip!();
    let shape = ops::EmbeddingShape {
        vocab: 6,
        dim: 40,
        length: 37,
        positions: false,
    };
    let rows = 3 * shape.length;
    let ids: Vec<f32> = (0..rows)
        .map(|r| match r % 7 {
            0 => 9.0,
            1 | 2 => (r % 5) as f32,
            _ => 0.0,
        })
        .collect();
    let g = random_vec(rows * shape.dim, 71, 1.0);
    let start = random_vec(shape.vocab * shape.dim, 72, 0.5);
    let mut expected = start.clone();
    for (r, &id) in ids.iter().enumerate() {
        if id < shape.vocab as f32 {
            let v = id as usize;
            for c in 0..shape.dim {
                expected[v * shape.dim + c] += g[r * shape.dim + c];
            }
        }
    }
    let ids = CudaTensor::from_tensor(
        &be,
        &Tensor::from_vec(&[3, shape.length], ids).unwrap(),
        DType::F32,
    )
    .unwrap();
    let g = CudaTensor::from_tensor(
        &be,
        &Tensor::from_vec(&[rows, shape.dim], g).unwrap(),
        DType::F32,
    )
    .unwrap();
    let mut dtable = upload_f32(&be, &start);
    ops::embedding_backward(&be, &ids, &g, shape, Some(&mut dtable.as_view_mut()), None).unwrap();
    let got = download(&be, &dtable);
    for (i, (a, b)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "dtable[{i}]: {a} against {b}");
    }
}

/// Token models: an embedding with positions, transformer blocks (dropout,
/// LoRA on the attention projections), a standalone attention and LoRA
/// linear, a per-token head; and two stacked LSTMs. `t` = 37 crosses the
/// attention kernels' 32-key chunks.
fn token_specs(checkpoint: &str) -> Vec<ModelSpec> {
    let models = [
        r#"tokens = { length = 37, vocab = 11 }
           layers = [
             { type = "embedding", dim = 16, positions = true },
             { type = "transformer_block", heads = 2, mlp_ratio = 2, dropout = 0.1 },
             { type = "layer_norm" },
             { type = "linear", out = 11 },
           ]"#,
        r#"tokens = { length = 37, vocab = 11 }
           layers = [
             { type = "embedding", dim = 16, positions = true },
             { type = "transformer_block", heads = 4, mlp_ratio = 2, lora = { r = 2, alpha = 4 } },
             { type = "causal_self_attention", heads = 2, lora = { r = 3 } },
             { type = "gelu" },
             { type = "lora_linear", out = 12, lora = { r = 2, alpha = 8 } },
             { type = "layer_norm" },
             { type = "linear", out = 11 },
           ]"#,
        r#"tokens = { length = 37, vocab = 11 }
           layers = [
             { type = "embedding", dim = 8 },
             { type = "lstm", hidden = 12 },
             { type = "lstm", hidden = 10 },
             { type = "linear", out = 11 },
           ]"#,
    ];
    models
        .iter()
        .map(|m| {
            let text = format!("[model]\ncheckpoint = \"{checkpoint}\"\n{m}");
            toml::from_str::<SpecFile>(&text).unwrap().model
        })
        .collect()
}

/// The CPU network of `spec`, with everything but the LoRA adapters frozen
/// when `frozen` (as `finetune.train = "lora"` does).
fn token_network(spec: &ModelSpec, frozen: bool) -> Network {
    let mut net = Network::build(spec, 21).unwrap();
    // A fresh adapter's B is zero, which would zero A's gradient and the
    // adapter's share of dx: give it values.
    for p in net.params_mut() {
        if p.name.ends_with("lora_b") {
            for (i, v) in p.value.data_mut().iter_mut().enumerate() {
                *v = ((i * 37 % 17) as f32 - 8.0) / 40.0;
            }
        }
    }
    if frozen {
        for p in net.params_mut() {
            if !(p.name.ends_with("lora_a") || p.name.ends_with("lora_b")) {
                p.freeze();
            }
        }
    }
    net
}

/// Two training passes and an eval forward of the GPU network built from
/// `token_network(spec, frozen)`: logits, gradients, buffers.
fn token_network_run(
    be: &CudaBackend,
    spec: &ModelSpec,
    frozen: bool,
    dtype: DType,
    batches: &[Tensor],
    grad_logits: &Tensor,
) -> (Vec<f32>, Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let options = CudaBuildOptions {
        activations: dtype,
        ..CudaBuildOptions::default()
    };
    let mut cpu = token_network(spec, frozen);
    let mut net = CudaNetwork::from_cpu(be, &mut cpu, options).unwrap();
    let g = CudaTensor::from_tensor(be, grad_logits, dtype).unwrap();
    let g = g.reshape(&[grad_logits.len() / 11, 11]).unwrap();
    let mut logits = Vec::new();
    for ids in batches {
        let x = CudaTensor::from_tensor(be, ids, DType::F32).unwrap();
        let y = net.forward_train(be, &x).unwrap();
        assert_eq!(y.shape(), &[ids.len(), 11]);
        logits.extend(y.to_host(be).unwrap());
        net.backward(be, &g).unwrap();
    }
    let x = CudaTensor::from_tensor(be, &batches[0], DType::F32).unwrap();
    logits.extend(net.forward_eval(be, &x).unwrap().to_host(be).unwrap());
    (
        logits,
        net.read_grads(be).unwrap(),
        net.read_buffers(be).unwrap(),
    )
}

/// `stream_state` hands on, in pieces of 5 values that end inside tensors,
/// the very values the network holds: every parameter's master (a frozen
/// one's too, as built from the CPU network), the buffers (dropout
/// counters), and both moments as loaded (none for a frozen parameter).
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_streamed_state_holds_what_the_network_holds() {
    let be = gpu_or_skip!();
    let specs = token_specs("none");
    for (spec, frozen) in [(&specs[0], false), (&specs[1], true)] {
        let mut cpu = token_network(spec, frozen);
        let params: Vec<Vec<f32>> = cpu
            .params_mut()
            .iter()
            .map(|p| p.value.data().to_vec())
            .collect();
        let trainable: Vec<bool> = cpu.params_mut().iter().map(|p| !p.frozen).collect();
        assert_eq!(trainable.contains(&false), frozen);
        let mut net = CudaNetwork::from_cpu(&be, &mut cpu, CudaBuildOptions::default()).unwrap();
        let moment = |seed: u64| -> Vec<Vec<f32>> {
            params
                .iter()
                .zip(&trainable)
                .enumerate()
                .map(|(i, (p, &t))| match t {
                    true => random_vec(p.len(), seed + i as u64, 1.0),
                    false => Vec::new(),
                })
                .collect()
        };
        let (first, second) = (moment(700), moment(800));
        let buffers = net.read_buffers(&be).unwrap();
        assert!(frozen || !buffers.is_empty(), "the dropout counters");
        net.load_state(&be, &params, &buffers, (&first, &second))
            .unwrap();
        let lists = [
            (StateList::Params, &params),
            (StateList::Buffers, &buffers),
            (StateList::FirstMoments, &first),
            (StateList::SecondMoments, &second),
        ];
        for (list, want) in lists {
            let (mut count, mut got) = (None, Vec::<Vec<f32>>::new());
            net.stream_state(&be, list, &mut [0.0; 5], &mut |piece| {
                match piece {
                    StatePiece::List(n) => count = Some(n),
                    StatePiece::Tensor(len) => got.push(Vec::with_capacity(len)),
                    StatePiece::Values(v) => got.last_mut().unwrap().extend_from_slice(v),
                }
                Ok::<(), CudaError>(())
            })
            .unwrap();
            assert_eq!(count, Some(want.len()), "{list:?} frozen {frozen}");
            assert!(got == *want, "{list:?} frozen {frozen}: the values differ");
        }
    }
}

/// Token networks against the CPU network, f32 and f16, trainable and
/// frozen as fine-tuning freezes them: logits, gradients (none for a frozen
/// parameter) and dropout counters; checkpointing blocks gives the same
/// bits as not.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn token_networks_match_the_cpu_network() {
    let be = gpu_or_skip!();
    let (n, t) = (3, 37);
    let batches: Vec<Tensor> = (0..2)
        .map(|b| {
            let ids = (0..n * t)
                .map(|i| ((i * 7 + b * 5 + i / 5) % 11) as f32)
                .collect();
            Tensor::from_vec(&[n, t], ids).unwrap()
        })
        .collect();
    let grad_logits = random(&[n, t, 11], 990, 0.05, 0.0);
    let plain = token_specs("none");
    let checkpointed = token_specs("blocks");
    for (i, (spec, spec_blocks)) in plain.iter().zip(&checkpointed).enumerate() {
        for frozen in [false, true] {
            if frozen && i != 1 {
                continue; // no adapters to train
            }
            let mut cpu = token_network(spec, frozen);
            let reference = cpu_run(&mut cpu, &batches, &grad_logits);
            let (want, cpu_grads, cpu_buffers) =
                (&reference.outputs, &reference.grads, &reference.buffers);
            for dtype in [DType::F32, DType::F16] {
                let what = format!("token network {i} frozen {frozen} {dtype:?}");
                let (logits, grads, buffers) =
                    token_network_run(&be, spec, frozen, dtype, &batches, &grad_logits);
                assert_eq!(&buffers, cpu_buffers, "{what}: dropout counters");
                let again =
                    token_network_run(&be, spec_blocks, frozen, dtype, &batches, &grad_logits);
                assert!(
                    logits
                        .iter()
                        .zip(&again.0)
                        .all(|(a, b)| a.to_bits() == b.to_bits())
                        && grads == again.1,
                    "{what}: checkpointing blocks changed the bits"
                );
                for (p, (g, c)) in grads.iter().zip(cpu_grads).enumerate() {
                    assert_eq!(g.len(), c.len(), "{what} param {p}: gradient length");
                }
                let tolerances = Tolerances {
                    f32_outputs: (1e-3, 1e-4),
                    f32_grads: (1e-3, 1e-3),
                    f16_outputs: 4e-3,
                    f16_grads: 2e-2,
                };
                assert_matches_cpu(
                    &what,
                    dtype,
                    (&logits, &grads),
                    (want, cpu_grads),
                    tolerances,
                );
            }
        }
    }
}
