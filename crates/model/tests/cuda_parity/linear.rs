//! Parity tests of the fully connected layer and its bias (`src/ops/linear`).

use super::*;

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn linear_matches_the_cpu_layer() {
    let be = gpu_or_skip!();
    for (n, inf, out, bias) in [(16usize, 128usize, 10usize, true), (5, 33, 7, false)] {
        let mut rng = InitRng::new(200 + n as u64);
        let mut lin = Linear::new("fc", inf, out, bias, &mut rng);
        let b = random_vec(out, 201, 0.5);
        let weight = {
            let mut p = lin.params_mut();
            round_f16(&mut p[0].value);
            if bias {
                p[1].value.data_mut().copy_from_slice(&b);
            }
            p[0].value.data().to_vec()
        };
        let x = random(&[n, inf], 202, 1.0, 0.0);
        let g = random(&[n, out], 203, 1.0, 0.0);
        let y = lin.forward(&x, Mode::Train).unwrap();
        let dx = lin.backward(&g).unwrap();
        let (dw, db) = {
            let p = lin.params_mut();
            (
                p[0].grad.data().to_vec(),
                p.get(1).map(|b| b.grad.data().to_vec()),
            )
        };
        let w_d = upload_f16(&be, &weight);
        let b_d = upload_f16(&be, &b);
        let gx = upload(&be, &x);
        let gy = ops::linear_forward(
            &be,
            &gx,
            &AnyView::F16(w_d.as_view()),
            bias.then(|| AnyView::F16(b_d.as_view())).as_ref(),
            out,
        )
        .unwrap();
        let mut dw_d = upload_f32(&be, &vec![0.0; weight.len()]);
        let mut db_d = upload_f32(&be, &vec![0.0; out]);
        let gdx = {
            let mut db_view = db_d.as_view_mut();
            ops::linear_backward(
                &be,
                &gx,
                &upload(&be, &g),
                &AnyView::F16(w_d.as_view()),
                &mut dw_d.as_view_mut(),
                if bias { Some(&mut db_view) } else { None },
            )
            .unwrap()
        };
        assert_close(
            "linear forward",
            &gy.to_host(&be).unwrap(),
            y.data(),
            2e-3,
            1e-3,
        );
        assert_close(
            "linear dx",
            &gdx.to_host(&be).unwrap(),
            dx.data(),
            2e-3,
            1e-3,
        );
        assert_close("linear dW", &download(&be, &dw_d), &dw, 1e-3, 1e-4);
        if let Some(db) = db {
            assert_close("linear db", &download(&be, &db_d), &db, 1e-3, 1e-4);
        }
        // Without dx (a network's first layer): the same dW and db, bit for bit.
        let mut dw_p = upload_f32(&be, &vec![0.0; weight.len()]);
        let mut db_p = upload_f32(&be, &vec![0.0; out]);
        {
            let mut db_view = db_p.as_view_mut();
            ops::linear_backward_params(
                &be,
                &gx,
                &upload(&be, &g),
                &AnyView::F16(w_d.as_view()),
                &mut dw_p.as_view_mut(),
                if bias { Some(&mut db_view) } else { None },
            )
            .unwrap();
        }
        assert_eq!(
            download(&be, &dw_p),
            download(&be, &dw_d),
            "linear dW alone"
        );
        assert_eq!(
            download(&be, &db_p),
            download(&be, &db_d),
            "linear db alone"
        );
    }
}

/// Bias gradients over many rows (the tokens of a sequence batch) are
/// summed by chunks of rows and then the chunks in order: the column sums
/// of a [1000, 70] gradient (4 chunks, the last part-filled; 3 column
/// blocks, the last part-filled), in f32 and f16, added to what the
/// gradient held, the same bits on a second run.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn bias_gradients_over_many_rows_sum_by_chunks() {
    let be = gpu_or_skip!();
    let (rows, cols) = (1000usize, 70usize);
    let mut g = Tensor::from_vec(&[rows, cols], random_vec(rows * cols, 81, 1.0)).unwrap();
    round_f16(&mut g);
    let start = random_vec(cols, 82, 0.5);
    let mut expected = start.clone();
    for row in g.data().chunks_exact(cols) {
        for (e, &v) in expected.iter_mut().zip(row) {
            *e += v;
        }
    }
    for dtype in [DType::F32, DType::F16] {
        let gd = CudaTensor::from_tensor(&be, &g, dtype).unwrap();
        let runs: Vec<Vec<f32>> = (0..2)
            .map(|_| {
                let mut grad = upload_f32(&be, &start);
                ops::bias_grad(&be, &gd.view(), &mut grad.as_view_mut()).unwrap();
                download(&be, &grad)
            })
            .collect();
        assert_close(
            &format!("{dtype:?} bias gradient"),
            &runs[0],
            &expected,
            1e-5,
            1e-5,
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&runs[0]), bits(&runs[1]), "{dtype:?}: two runs differ");
    }
}
