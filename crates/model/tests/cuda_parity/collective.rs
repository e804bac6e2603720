//! Parity tests of the data-parallel ranks' sum (`src/ops/collective`).

use super::*;

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn the_ranks_sum_adds_in_rank_order_to_the_bits_of_the_cpu() {
    let be = gpu_or_skip!();
    for (world, n, stride) in [
        (1usize, 37usize, 37usize),
        (2, 1000, 1003),
        (3, 777, 777),
        (5, 64, 70),
    ] {
        // Values whose sum depends on the order: large and small of both
        // signs, so a reordered or fused sum shows up in the last bits.
        let mut parts = random_vec(world * stride, world as u64, 1.0);
        for (i, v) in parts.iter_mut().enumerate() {
            if i % 3 == 0 {
                *v *= 1e7;
            }
        }
        let want: Vec<f32> = (0..n)
            .map(|i| {
                let mut sum = parts[i];
                for r in 1..world {
                    sum += parts[r * stride + i];
                }
                sum
            })
            .collect();
        let dev = be.upload(&parts).unwrap();
        let mut out = be.alloc_zeros::<f32>(n).unwrap();
        ops::rank_sum(
            &be,
            &dev.slice.as_view(),
            world,
            stride,
            &mut out.slice.as_view_mut(),
        )
        .unwrap();
        let got = be.download(&out.slice).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "world {world}, value {i}: {g} vs {w}"
            );
        }
    }
    // A slice longer than the stride, or copies too short, is refused.
    let dev = be.upload(&[0.0f32; 10]).unwrap();
    let mut out = be.alloc_zeros::<f32>(6).unwrap();
    assert!(ops::rank_sum(
        &be,
        &dev.slice.as_view(),
        2,
        5,
        &mut out.slice.as_view_mut()
    )
    .is_err());
    let mut out = be.alloc_zeros::<f32>(4).unwrap();
    assert!(ops::rank_sum(
        &be,
        &dev.slice.as_view(),
        3,
        5,
        &mut out.slice.as_view_mut()
    )
    .is_err());
}
