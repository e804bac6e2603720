//! Times the CPU convolution on every convolution shape of the reference
//! ResNet (Fashion-MNIST 28×28×1, batch 128): forward (training mode) and
//! backward (input gradient + weight gradient), after a warm-up.
//!
//! cargo run --release -p headroom-model --example conv_bench [-- THREADS [BATCH [SHAPE [ALGORITHMS]]]]
//!
//! THREADS sizes rayon's pool (default: one per core), SHAPE (`all`, an
//! index into SHAPES, or `HxWxCIN:COUT` for a 3×3 stride-1 layer outside
//! the network) chooses what is timed. ALGORITHMS (default
//! `direct,auto`; `/avx2` after a name keeps the AVX2 tiles on an AVX-512
//! CPU, e.g. `auto/avx2,auto`) are timed side by side, alternating shape by shape, so
//! that both see the same machine load; `winograd` forces Winograd on every
//! shape it can take. FLOP/s count the direct convolution's arithmetic
//! (direct-convolution-equivalent), so Winograd can pass the FMA peak.

use std::time::Instant;

use headroom_model::init::InitRng;
use headroom_model::layers::{
    set_conv_algorithm, set_cpu_kernels, Conv2d, ConvAlgorithm, CpuKernels,
};
use headroom_model::{Layer, Mode, Tensor};

/// (h, w, cin, cout, kernel, stride, count in the network)
type Shape = (usize, usize, usize, usize, usize, usize, usize);

const SHAPES: &[Shape] = &[
    (28, 28, 1, 32, 3, 1, 1),
    (28, 28, 32, 32, 3, 1, 2),
    (28, 28, 32, 64, 3, 2, 1),
    (14, 14, 64, 64, 3, 1, 2),
    (14, 14, 64, 128, 3, 2, 1),
    (7, 7, 128, 128, 3, 1, 2),
];

/// CPU time of all this process's threads (Linux), to see through other
/// processes competing for the cores: GFLOP per CPU-second is what the code
/// achieves per core, whatever the load. (Idle rayon workers spin briefly,
/// so it slightly overstates CPU time with several threads.)
fn cpu_seconds() -> Option<f64> {
    let mut total = 0u64;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let stat = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        total += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(total as f64 * 1e-9)
}

/// The best of the timed runs: on a shared machine other processes only
/// ever add time.
fn best(v: Vec<f64>) -> f64 {
    v.into_iter().fold(f64::INFINITY, f64::min)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    if let Some(threads) = args.next() {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads.parse()?)
            .build_global()?;
    }
    let batch: usize = args.next().map(|b| b.parse()).transpose()?.unwrap_or(128);
    let shapes = match args.next() {
        None => SHAPES.to_vec(),
        Some(spec) => parse_shapes(&spec)?,
    };
    let algorithms = args
        .next()
        .unwrap_or_else(|| "direct,auto".into())
        .split(',')
        .map(parse_variant)
        .collect::<Result<Vec<_>, _>>()?;
    println!(
        "conv bench: batch {batch}, {} threads, best of the timed runs after 3 warm-up runs; \
         GF/s in direct-convolution-equivalent FLOP",
        rayon::current_num_threads()
    );
    let mut totals = vec![Totals::default(); algorithms.len()];
    println!(
        "{:<24} {:>11} {:>5} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7}",
        "shape",
        "algorithm",
        "count",
        "fwd ms",
        "GF/s",
        "GF/cpu-s",
        "bwd ms",
        "GF/s",
        "GF/cpu-s",
        "GFLOP"
    );
    let mut rng = InitRng::new(1);
    for &(h, w, cin, cout, k, stride, count) in &shapes {
        let mut conv = Conv2d::new("bench", cin, cout, k, stride, k / 2, false, &mut rng)?;
        let data: Vec<f32> = (0..batch * h * w * cin)
            .map(|_| rng.normal() as f32)
            .collect();
        let x = Tensor::from_vec(&[batch, h, w, cin], data)?;
        let macs = conv.macs(&[h, w, cin])? as f64 * batch as f64;
        let fwd_flop = 2.0 * macs;
        // Backward = input gradient + weight gradient, each a forward's worth.
        let bwd_flop = 2.0 * fwd_flop;
        let reps = ((20e9 / fwd_flop) as usize).clamp(5, 50);
        for ((algorithm, kernels, label), totals) in algorithms.iter().zip(totals.iter_mut()) {
            set_conv_algorithm(*algorithm);
            set_cpu_kernels(*kernels);
            let (mut fwd, mut bwd, mut fwd_cpu, mut bwd_cpu) = (vec![], vec![], vec![], vec![]);
            for rep in 0..reps + 3 {
                let (t, c) = (Instant::now(), cpu_seconds());
                let y = conv.forward(&x, Mode::Train)?;
                let (tf, cf) = (t.elapsed().as_secs_f64() * 1e3, cpu_seconds());
                let dx = conv.backward(&y)?;
                let (tb, cb) = (t.elapsed().as_secs_f64() * 1e3 - tf, cpu_seconds());
                std::hint::black_box(dx);
                if rep >= 3 {
                    fwd.push(tf);
                    bwd.push(tb);
                    if let (Some(c), Some(cf), Some(cb)) = (c, cf, cb) {
                        fwd_cpu.push(cf - c);
                        bwd_cpu.push(cb - cf);
                    }
                }
            }
            let (f, b) = (best(fwd), best(bwd));
            let per_cpu = |flop: f64, v: Vec<f64>| {
                if v.is_empty() {
                    f64::NAN
                } else {
                    flop / best(v) / 1e9
                }
            };
            let (fc, bc) = (per_cpu(fwd_flop, fwd_cpu), per_cpu(bwd_flop, bwd_cpu));
            let name = format!("{h}x{w}x{cin} -> {cout} {k}x{k}/{stride}");
            println!(
            "{name:<24} {label:>11} {count:>5} {f:>8.2} {:>8.1} {fc:>8.1} {b:>8.2} {:>8.1} {bc:>8.1} {:>7.2}",
            fwd_flop / f / 1e6,
            bwd_flop / b / 1e6,
            (fwd_flop + bwd_flop) / 1e9
        );
            totals.ms += count as f64 * (f + b);
            totals.fwd_ms += count as f64 * f;
            totals.bwd_ms += count as f64 * b;
            totals.flop += count as f64 * (fwd_flop + bwd_flop);
            totals.cpu += count as f64 * (fwd_flop / fc + bwd_flop / bc);
        }
    }
    for ((_, _, label), t) in algorithms.iter().zip(&totals) {
        println!(
            "{label:>11}: all convs of the network, one step: forward {:.1} ms + backward {:.1} ms \
             = {:.1} ms, {:.1} GFLOP, {:.1} GFLOP/s ({:.1} GFLOP per CPU-second)",
            t.fwd_ms,
            t.bwd_ms,
            t.ms,
            t.flop / 1e9,
            t.flop / t.ms / 1e6,
            t.flop / t.cpu
        );
    }
    Ok(())
}

/// `all` (the reference ResNet's shapes), an index into SHAPES, or
/// `HxWxCIN:COUT` for one 3×3 stride-1 shape outside the network (counted
/// once in the totals), e.g. `32x32x48:16`, conv_lstm's decoder layer.
fn parse_shapes(spec: &str) -> Result<Vec<Shape>, String> {
    let bad = || {
        format!(
            "shape {spec:?}: expected all, 0-{}, or HxWxCIN:COUT",
            SHAPES.len() - 1
        )
    };
    if spec == "all" {
        return Ok(SHAPES.to_vec());
    }
    if let Ok(i) = spec.parse::<usize>() {
        return SHAPES.get(i).map(|s| vec![*s]).ok_or_else(bad);
    }
    let (image, cout) = spec.split_once(':').ok_or_else(bad)?;
    let dims = image
        .split('x')
        .map(|d| d.parse::<usize>().map_err(|_| bad()))
        .collect::<Result<Vec<_>, _>>()?;
    let cout = cout.parse::<usize>().map_err(|_| bad())?;
    match dims[..] {
        [h, w, cin] if h > 0 && w > 0 && cin > 0 && cout > 0 => {
            Ok(vec![(h, w, cin, cout, 3, 1, 1)])
        }
        _ => Err(bad()),
    }
}

/// "direct", "winograd" or "auto", with "/avx2" to keep the AVX2 tiles on
/// an AVX-512 CPU: the algorithm, the kernels and the label to print.
fn parse_variant(text: &str) -> Result<(ConvAlgorithm, CpuKernels, String), String> {
    let (name, kernels) = match text.strip_suffix("/avx2") {
        Some(name) => (name, CpuKernels::Avx2),
        None => (text, CpuKernels::Auto),
    };
    let algorithm = match name {
        "direct" => ConvAlgorithm::Direct,
        "winograd" => ConvAlgorithm::Winograd,
        "winograd4" => ConvAlgorithm::Winograd4,
        "auto" => ConvAlgorithm::Auto,
        other => {
            return Err(format!(
                "unknown algorithm {other:?} (direct, winograd, winograd4, auto; add /avx2 for the AVX2 tiles)"
            ))
        }
    };
    Ok((algorithm, kernels, text.to_string()))
}

/// One algorithm's sums over the network's convolutions.
#[derive(Clone, Default)]
struct Totals {
    ms: f64,
    fwd_ms: f64,
    bwd_ms: f64,
    flop: f64,
    cpu: f64,
}
