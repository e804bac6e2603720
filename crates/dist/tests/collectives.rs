//! The collectives and the reducer on ranks as threads.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use headroom_dist::collective::{all_gather, all_reduce_ordered, require_equal, slice_of};
use headroom_dist::threads::{group, ThreadTransport};
use headroom_dist::{BucketPlan, DistError, GradientReducer, SharedTransport, Transport};

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

/// Runs `f(rank, transport)` on one thread per rank and returns the
/// results in rank order.
fn on_ranks<T: Send + 'static>(
    world: usize,
    f: impl Fn(usize, ThreadTransport) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let handles: Vec<_> = group(world)
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let f = Arc::clone(&f);
            std::thread::spawn(move || f(rank, t))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

/// Values whose sum depends on the order they are added in.
fn awkward(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let x = ((i * 7919 + rank * 104_729) % 1000) as f32;
            (x - 500.0) * 10f32.powi((i % 9) as i32 - 4) + rank as f32 * 1e-3
        })
        .collect()
}

#[test]
fn the_all_reduce_is_the_rank_ordered_sum_with_the_same_bits_on_every_rank() {
    for world in [2, 3, 5] {
        for len in [0, 1, 4, 1001] {
            let expected: Vec<f32> = (0..len)
                .map(|i| {
                    let mut s = awkward(0, len)[i];
                    for r in 1..world {
                        s += awkward(r, len)[i];
                    }
                    s
                })
                .collect();
            let got = on_ranks(world, move |rank, mut t| {
                let mut data = awkward(rank, len);
                let mut scratch = Vec::new();
                all_reduce_ordered(&mut t, 7, &mut data, &mut scratch, soon(), "test")
                    .expect("all-reduce");
                data
            });
            for (rank, data) in got.iter().enumerate() {
                let same = data
                    .iter()
                    .zip(&expected)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same && data.len() == len,
                    "world {world}, len {len}, rank {rank}"
                );
            }
        }
    }
}

#[test]
fn the_order_of_the_sum_is_not_the_order_messages_arrive_in() {
    // Rank 2 is late: the sum is the same bits as when nobody is.
    let run = |late: bool| {
        on_ranks(3, move |rank, mut t| {
            if late && rank == 2 {
                std::thread::sleep(Duration::from_millis(50));
            }
            let mut data = awkward(rank, 300);
            all_reduce_ordered(&mut t, 1, &mut data, &mut Vec::new(), soon(), "test").expect("ok");
            data
        })
    };
    let (a, b) = (run(false), run(true));
    assert!(a[0]
        .iter()
        .zip(&b[0])
        .all(|(x, y)| x.to_bits() == y.to_bits()));
}

#[test]
fn slices_cover_the_vector_once() {
    for (len, world) in [(10, 3), (2, 5), (0, 2), (1_000_003, 8)] {
        let mut next = 0;
        for j in 0..world {
            let s = slice_of(len, world, j);
            assert_eq!(s.start, next);
            next = s.end;
        }
        assert_eq!(next, len);
    }
}

#[test]
fn all_gather_returns_every_rank_s_record_in_rank_order() {
    let got = on_ranks(4, |rank, mut t| {
        all_gather(&mut t, 3, &[rank as u8, 9], soon(), "test").expect("gather")
    });
    for records in got {
        assert_eq!(
            records,
            vec![vec![0, 9], vec![1, 9], vec![2, 9], vec![3, 9]]
        );
    }
}

#[test]
fn a_rank_with_other_settings_is_named_at_start() {
    let got = on_ranks(3, |rank, mut t| {
        let config = if rank == 1 { "lr = 0.1" } else { "lr = 0.2" };
        require_equal(&mut t, 5, "config", config.as_bytes(), soon()).map_err(|e| e.to_string())
    });
    for result in got {
        let message = result.expect_err("ranks disagree");
        assert!(
            message.contains("rank 1") && message.contains("config"),
            "{message}"
        );
    }
}

#[test]
fn a_rank_that_never_answers_is_named_at_the_deadline() {
    let mut ranks = group(3).into_iter();
    let mut zero = ranks.next().expect("rank 0");
    let one = ranks.next().expect("rank 1");
    let _two = ranks.next();
    // Rank 1 answers; rank 2 exists but never calls.
    let helper = std::thread::spawn(move || {
        let mut one = one;
        let _ = all_gather(
            &mut one,
            3,
            &[1],
            Instant::now() + Duration::from_millis(300),
            "test",
        );
    });
    let started = Instant::now();
    let err = all_gather(
        &mut zero,
        3,
        &[0],
        Instant::now() + Duration::from_millis(300),
        "a step",
    )
    .expect_err("rank 2 is silent");
    helper.join().expect("helper");
    assert!(started.elapsed() < Duration::from_secs(5));
    match err {
        DistError::Timeout { missing, .. } => assert_eq!(missing, vec![2]),
        other => panic!("expected a timeout, got {other}"),
    }
}

#[test]
fn buckets_hold_whole_tensors_up_to_the_size() {
    let plan = BucketPlan::new(&[5, 5, 20, 1, 1, 1], 10);
    assert_eq!(plan.bucket_lens().collect::<Vec<_>>(), vec![10, 20, 3]);
    assert_eq!(plan.tensors(), 6);
    assert_eq!(BucketPlan::new(&[], 10).buckets(), 0);
}

fn shared(t: ThreadTransport) -> SharedTransport {
    Arc::new(Mutex::new(Box::new(t) as Box<dyn Transport>))
}

#[test]
fn the_reducer_gives_the_all_reduce_of_every_tensor_whatever_the_bucket_size() {
    let lens = [3usize, 100, 7, 0, 64];
    let expected: Vec<Vec<f32>> = lens
        .iter()
        .enumerate()
        .map(|(t, &len)| {
            let mut s = awkward(t, len);
            for r in 1..3 {
                let v = awkward(t + 10 * r, len);
                s.iter_mut().zip(&v).for_each(|(a, b)| *a += b);
            }
            s
        })
        .collect();
    for bucket in [1, 50, 10_000] {
        let got = on_ranks(3, move |rank, t| {
            let mut reducer =
                GradientReducer::new(shared(t), &lens, bucket, Duration::from_secs(20))
                    .expect("reducer");
            let mut out: Vec<Vec<f32>> = lens.iter().map(|&l| vec![0.0; l]).collect();
            // Two steps: the reducer is reusable.
            for _ in 0..2 {
                // In production order, as backward hands them over.
                for (t, &len) in lens.iter().enumerate() {
                    let grad = awkward(t + 10 * rank, len);
                    reducer.ready(t, &grad).expect("ready");
                }
                reducer
                    .finish(|t, sum| out[t].copy_from_slice(sum))
                    .expect("finish");
            }
            out
        });
        for (rank, out) in got.iter().enumerate() {
            for (t, (a, b)) in out.iter().zip(&expected).enumerate() {
                let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "bucket {bucket}, rank {rank}, tensor {t}");
            }
        }
    }
}

#[test]
fn an_aborted_step_still_completes_every_peer_s_buckets() {
    let lens = [10usize, 10, 10];
    let got = on_ranks(2, move |rank, t| {
        let mut reducer =
            GradientReducer::new(shared(t), &lens, 10, Duration::from_secs(20)).expect("reducer");
        if rank == 0 {
            for t in 0..3 {
                reducer.ready(t, &[1.0; 10]).expect("ready");
            }
        } else {
            // Rank 1 fails after its first tensor, and hands over the last
            // one out of order: the buckets still pair up.
            reducer.ready(2, &[1.0; 10]).expect("ready");
            reducer.ready(0, &[1.0; 10]).expect("ready");
            reducer.abort_step().expect("abort");
        }
        let mut sums = vec![0.0f32; 3];
        reducer.finish(|t, s| sums[t] = s[0]).expect("finish");
        sums
    });
    assert_eq!(got[0], vec![2.0, 1.0, 2.0]);
    assert_eq!(got[1], got[0]);
}

#[test]
fn a_tensor_never_handed_over_is_an_error_not_a_hang() {
    let mut ranks = group(1).into_iter();
    let t = ranks.next().expect("rank 0");
    let mut reducer =
        GradientReducer::new(shared(t), &[4, 4], 4, Duration::from_secs(1)).expect("reducer");
    reducer.ready(1, &[0.0; 4]).expect("ready");
    let err = reducer.finish(|_, _| {}).expect_err("tensor 0 missing");
    assert!(err.to_string().contains("tensor 0"), "{err}");
}

#[test]
fn owners_are_consecutive_and_the_slices_cover_every_bucket() {
    for world in [1usize, 2, 3, 5] {
        for (lens, bucket) in [
            (vec![3usize, 100, 7, 0, 64, 1, 1, 30], 50usize),
            (vec![1000, 1, 1], 1),
            (vec![5; 40], 12),
            (vec![0, 0], 4),
        ] {
            let plan = BucketPlan::new(&lens, bucket);
            let owners = plan.owners(&lens, world);
            assert!(owners.windows(2).all(|w| w[0] <= w[1]), "{owners:?}");
            assert!(owners.iter().all(|&o| o < world));
            let slices = plan.owner_slices(&owners, world);
            for (b, (bucket, len)) in slices.iter().zip(plan.bucket_lens()).enumerate() {
                assert_eq!(bucket.len(), world);
                assert_eq!(bucket[0].start, 0, "bucket {b}");
                assert_eq!(bucket[world - 1].end, len, "bucket {b}");
                assert!(bucket.windows(2).all(|w| w[0].end == w[1].start));
            }
        }
    }
    // Many equal tensors are spread over every rank, about equally.
    let lens = vec![10usize; 30];
    let owners = BucketPlan::new(&lens, 25).owners(&lens, 3);
    for r in 0..3 {
        assert_eq!(owners.iter().filter(|&&o| o == r).count(), 10, "{owners:?}");
    }
}

#[test]
fn sharded_each_rank_gets_its_tensors_sums_and_every_rank_the_gathered_updates() {
    let lens = [3usize, 100, 7, 0, 64, 20, 20];
    let world = 3;
    let expected: Vec<Vec<f32>> = lens
        .iter()
        .enumerate()
        .map(|(t, &len)| {
            let mut s = awkward(t, len);
            for r in 1..world {
                let v = awkward(t + 10 * r, len);
                s.iter_mut().zip(&v).for_each(|(a, b)| *a += b);
            }
            s
        })
        .collect();
    for bucket in [1, 50, 10_000] {
        let got = on_ranks(world, move |rank, t| {
            let mut reducer =
                GradientReducer::sharded(shared(t), &lens, bucket, Duration::from_secs(20))
                    .expect("reducer");
            let mut sums: Vec<Option<Vec<f32>>> = vec![None; lens.len()];
            for (t, &len) in lens.iter().enumerate() {
                reducer
                    .ready(t, &awkward(t + 10 * rank, len))
                    .expect("ready");
            }
            reducer
                .finish(|t, sum| sums[t] = Some(sum.to_vec()))
                .expect("finish");
            let owners: Vec<usize> = (0..lens.len())
                .map(|t| reducer.owner(t).expect("sharded"))
                .collect();
            // The "update": the owner's sum plus its rank; the others'
            // tensors start as garbage and must come back as the owner's.
            let mut updated: Vec<Vec<f32>> = (0..lens.len())
                .map(|t| match &sums[t] {
                    Some(s) => s.iter().map(|v| v + owners[t] as f32).collect(),
                    None => vec![f32::NAN; lens[t]],
                })
                .collect();
            let mut views: Vec<&mut [f32]> = updated.iter_mut().map(Vec::as_mut_slice).collect();
            reducer.gather_owned(&mut views).expect("gather");
            (sums, owners, updated)
        });
        for (rank, (sums, owners, updated)) in got.iter().enumerate() {
            assert_eq!(owners, &got[0].1, "the ranks agree on the owners");
            for t in 0..lens.len() {
                assert_eq!(
                    sums[t].is_some(),
                    owners[t] == rank,
                    "rank {rank} tensor {t}"
                );
                if let Some(s) = &sums[t] {
                    let same = s
                        .iter()
                        .zip(&expected[t])
                        .all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(
                        same,
                        "bucket {bucket}, rank {rank}, tensor {t}: not the ordered sum"
                    );
                }
                let want: Vec<u32> = expected[t]
                    .iter()
                    .map(|v| (v + owners[t] as f32).to_bits())
                    .collect();
                let have: Vec<u32> = updated[t].iter().map(|v| v.to_bits()).collect();
                assert_eq!(have, want, "bucket {bucket}, rank {rank}, tensor {t}");
            }
        }
        // Every rank owns something here.
        for r in 0..world {
            assert!(got[0].1.contains(&r), "{:?}", got[0].1);
        }
    }
}
