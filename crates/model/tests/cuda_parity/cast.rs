//! Parity tests of casts and input normalisation (`src/ops/cast`).

use super::*;

// Casts and input

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn casts_round_like_half_and_widen_exactly() {
    let be = gpu_or_skip!();
    let mut values = random_vec(1000, 1, 10.0);
    // Unrounded values, overflow, subnormals, signed zero, NaN, infinities.
    values.extend([
        0.1,
        1.0 / 3.0,
        65504.0,
        65519.0,
        65520.0,
        1e6,
        -1e6,
        1e-8,
        3e-8,
        6e-8,
        -0.0,
        0.0,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        2049.0,
        2051.0,
    ]);
    let x = CudaTensor::from_host(&be, &[values.len()], &values, DType::F32).unwrap();
    let y = ops::cast_f32_to_f16(&be, &x).unwrap();
    let got: Vec<f16> = be.download(y.f16().unwrap()).unwrap();
    for (i, (&g, &v)) in got.iter().zip(&values).enumerate() {
        let want = f16::from_f32(v);
        assert!(
            g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
            "f32→f16 of {v} at {i}: gpu {g} ({:#06x}), half {want} ({:#06x})",
            g.to_bits(),
            want.to_bits()
        );
    }
    let back = ops::cast_f16_to_f32(&be, &y).unwrap().to_host(&be).unwrap();
    for (i, (&b, &g)) in back.iter().zip(&got).enumerate() {
        assert!(
            b.to_bits() == g.to_f32().to_bits() || (b.is_nan() && g.is_nan()),
            "f16→f32 at {i}"
        );
    }
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn u8_batches_normalise_like_the_cpu() {
    let be = gpu_or_skip!();
    let shape = [4, 28, 28, 1];
    let mut rng = InitRng::new(2);
    let pixels: Vec<u8> = (0..shape.iter().product())
        .map(|_| (rng.next_u64() % 256) as u8)
        .collect();
    let (mean, std) = (0.2860, 0.3530);
    let cpu = Tensor::from_u8_normalized(&shape, &pixels, mean, std).unwrap();
    let dev = be.upload(&pixels).unwrap();
    let gpu = ops::normalize_u8(&be, &dev.slice.as_view(), &shape, f16_input(mean, std)).unwrap();
    // One f16 rounding of the f32 value (the GPU may fuse the multiply-add).
    assert_close(
        "normalize_u8",
        &gpu.to_host(&be).unwrap(),
        cpu.data(),
        1e-3,
        1e-4,
    );
    // f32 training's input: the f32 value itself, up to that fused rounding.
    let f32_input = Normalization {
        mean,
        std,
        dtype: DType::F32,
    };
    let gpu = ops::normalize_u8(&be, &dev.slice.as_view(), &shape, f32_input).unwrap();
    assert_eq!(gpu.dtype(), DType::F32);
    assert_close(
        "normalize_u8 f32",
        &gpu.to_host(&be).unwrap(),
        cpu.data(),
        1e-6,
        1e-6,
    );
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn staged_batches_arrive_normalised_with_their_labels() {
    let be = gpu_or_skip!();
    let shape = [8, 28, 28, 1];
    let per_batch: usize = shape.iter().product();
    let mut staging = InputStaging::new(&be, 2, per_batch, 8).unwrap();
    let mut kept = Vec::new();
    // Three batches through two slots: the third reuses the first slot while
    // the first batch's tensors are still alive.
    for b in 0..3u64 {
        let mut rng = InitRng::new(10 + b);
        let pixels: Vec<u8> = (0..per_batch)
            .map(|_| (rng.next_u64() % 256) as u8)
            .collect();
        let labels: Vec<u32> = (0..8).map(|i| (i + b as u32) % 10).collect();
        let staged = staging
            .stage(&be, &shape, &pixels, &labels, 10, f16_input(0.5, 0.25))
            .unwrap();
        kept.push((pixels, labels, staged));
    }
    for (pixels, labels, staged) in &kept {
        let cpu = Tensor::from_u8_normalized(&shape, pixels, 0.5, 0.25).unwrap();
        assert_close(
            "staged images",
            &staged.images.to_host(&be).unwrap(),
            cpu.data(),
            1e-3,
            1e-4,
        );
        assert_eq!(&be.download(&staged.labels.slice).unwrap(), labels);
    }
    let err = staging
        .stage(
            &be,
            &shape,
            &vec![0u8; per_batch],
            &[10; 8],
            10,
            f16_input(0.5, 0.25),
        )
        .unwrap_err();
    assert!(err.to_string().contains("label 10"), "{err}");
}

/// The loader's crop and flip, pixel by pixel (an independent reference):
/// output (y, x) is padded pixel (y + dy, x' + dx), x' = w - 1 - x if flipped.
fn crop_flip_reference(src: &[u8], [h, w, c]: [usize; 3], [_, word]: [u32; 2]) -> Vec<u8> {
    let (dy, dx) = ((word & 255) as i64, ((word >> 8) & 255) as i64);
    let (flip, pad) = ((word >> 16) & 1 == 1, (word >> 24) as i64);
    let mut out = Vec::with_capacity(h * w * c);
    for y in 0..h as i64 {
        for x in 0..w as i64 {
            let x = if flip { w as i64 - 1 - x } else { x };
            let (sy, sx) = (y + dy - pad, x + dx - pad);
            for ch in 0..c {
                let inside = (0..h as i64).contains(&sy) && (0..w as i64).contains(&sx);
                out.push(if inside {
                    src[((sy as usize * w) + sx as usize) * c + ch]
                } else {
                    0
                });
            }
        }
    }
    out
}

fn recipe(id: u32, pad: u32, dy: u32, dx: u32, flip: bool) -> [u32; 2] {
    [id, dy | dx << 8 | u32::from(flip) << 16 | pad << 24]
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn batches_made_from_a_resident_set_equal_staged_host_batches() {
    let be = gpu_or_skip!();
    let shape = [6, 5, 3];
    let sample: usize = shape.iter().product();
    let mut rng = InitRng::new(21);
    let set_pixels: Vec<u8> = (0..7 * sample)
        .map(|_| (rng.next_u64() % 256) as u8)
        .collect();
    let set = ResidentImages::upload(&be, shape, &set_pixels).unwrap();
    assert_eq!((set.samples(), set.bytes()), (7, 7 * sample as u64));
    let recipes = [
        recipe(6, 0, 0, 0, false),
        recipe(0, 2, 0, 4, true),
        recipe(3, 2, 4, 0, false),
        recipe(3, 2, 2, 2, true),
        recipe(1, 5, 10, 0, true),
        recipe(5, 1, 1, 2, false),
    ];
    let labels: Vec<u32> = (0..recipes.len() as u32).collect();
    let mut staging = InputStaging::new(&be, 2, 6 * sample, 6).unwrap();
    let mut host = Vec::new();
    for r in &recipes {
        let id = r[0] as usize;
        host.extend(crop_flip_reference(
            &set_pixels[id * sample..(id + 1) * sample],
            shape,
            *r,
        ));
    }
    let batch_shape = [recipes.len(), 6, 5, 3];
    // Twice through the ring per storage type, with a host batch between:
    // slots are shared.
    for dtype in [DType::F16, DType::F16, DType::F32, DType::F32] {
        let norm = Normalization {
            mean: 0.3,
            std: 0.4,
            dtype,
        };
        let made = staging
            .stage_recipes(&be, &set, &recipes, &labels, 8, norm)
            .unwrap();
        let staged = staging
            .stage(&be, &batch_shape, &host, &labels, 8, norm)
            .unwrap();
        assert_eq!(made.images.dtype(), dtype);
        let bits = |t: &CudaTensor| -> Vec<u32> {
            t.to_host(&be)
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        assert_eq!(made.images.shape(), &batch_shape);
        assert_eq!(bits(&made.images), bits(&staged.images), "same bits");
        assert_eq!(be.download(&made.labels.slice).unwrap(), labels);
    }
    for (bad, what) in [
        (recipe(7, 0, 0, 0, false), "id 7"),
        (recipe(0, 2, 5, 0, false), "dy 5"),
        (recipe(0, 6, 0, 0, false), "pad 6"),
        ([0, 1 << 17], "word"),
    ] {
        let err = staging
            .stage_recipes(&be, &set, &[bad], &[0], 8, f16_input(0.3, 0.4))
            .unwrap_err();
        assert!(err.to_string().contains(what), "{what}: {err}");
    }
}
