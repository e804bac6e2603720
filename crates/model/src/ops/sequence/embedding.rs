//! Token embedding: ids [N, T] -> vectors [N, T, D], out[n, t] = table[id]
//! (+ pos[t] with learned positions, as GPT-2 has).
//!
//! Ids arrive as f32 values (the network's input for `model.tokens`, see
//! `Network::input_from_tokens`), exact up to 2^24; an id that is not an
//! integer in 0..vocab is an error naming the position.
//!
//! Saves for backward: the id tensor (a reference-counted handle). Backward
//! scatters the gradient into the rows of the table that were used (and
//! sums it over the batch into the positions); ids have no gradient, so the
//! returned input gradient is zeros.

use crate::init::InitRng;
use crate::ops::activation::relu::par_rows;
use crate::{Layer, Mode, ModelError, Param, Result, Tensor};

/// GPT-2's initialisation of both tables.
const INIT_STD: f64 = 0.02;

pub struct Embedding {
    pub(crate) vocab: usize,
    pub(crate) dim: usize,
    table: Param,
    pub(crate) positions: Option<Param>,
    saved_ids: Option<Tensor>,
}

fn normal_table(rng: &mut InitRng, rows: usize, cols: usize) -> Tensor {
    let data = (0..rows * cols)
        .map(|_| (rng.normal() * INIT_STD) as f32)
        .collect();
    Tensor::from_vec_unbudgeted(&[rows, cols], data)
}

impl Embedding {
    /// `max_positions` = Some(T) adds a learned position table of T rows.
    pub fn new(
        name: &str,
        vocab: usize,
        dim: usize,
        max_positions: Option<usize>,
        rng: &mut InitRng,
    ) -> Self {
        let table = Param::new(format!("{name}.table"), normal_table(rng, vocab, dim), true);
        let positions = max_positions.map(|t| {
            Param::new(
                format!("{name}.positions"),
                normal_table(rng, t, dim),
                false,
            )
        });
        Self {
            vocab,
            dim,
            table,
            positions,
            saved_ids: None,
        }
    }

    /// Token ids of [n, t] as table rows; positions past the position table
    /// are an error.
    fn token_rows(&self, ids: &Tensor) -> Result<Vec<usize>> {
        let [_, t] = *ids.shape() else {
            return Err(ModelError::Shape {
                op: "embedding",
                expected: "token ids [n, t]".into(),
                got: format!("{:?}", ids.shape()),
            });
        };
        if let Some(p) = &self.positions {
            if t > p.value.shape()[0] {
                return Err(ModelError::Shape {
                    op: "embedding",
                    expected: format!("at most {} positions", p.value.shape()[0]),
                    got: format!("{t}"),
                });
            }
        }
        ids.data()
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                let id = v.round();
                if id.is_finite() && id >= 0.0 && (id as usize) < self.vocab {
                    Ok(id as usize)
                } else {
                    Err(ModelError::Shape {
                        op: "embedding",
                        expected: format!("token ids in 0..{}", self.vocab),
                        got: format!("{v} at position {i}"),
                    })
                }
            })
            .collect()
    }
}

impl Layer for Embedding {
    cuda_form!(crate::ops::sequence::layer::EmbeddingLayer::from_cpu);

    fn describe(&self) -> String {
        let pos = if self.positions.is_some() {
            " + positions"
        } else {
            ""
        };
        format!("embedding {}x{}{pos}", self.vocab, self.dim)
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        match *input {
            [t] => Ok(vec![t, self.dim]),
            _ => Err(ModelError::Shape {
                op: "embedding",
                expected: "token ids [t]".into(),
                got: format!("{input:?}"),
            }),
        }
    }

    fn macs(&self, _input: &[usize]) -> Result<u64> {
        Ok(0)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.saved_ids = None;
        let rows = self.token_rows(input)?;
        let (n, t, d) = (input.shape()[0], input.shape()[1], self.dim);
        let table = self.table.value.data();
        let positions = self.positions.as_ref().map(|p| p.value.data());
        // SAFETY: row `token` gets all d values of its table row (plus its
        // position's).
        let out = unsafe {
            par_rows(&[n, t, d], d, |token, out| {
                let row = &table[rows[token] * d..][..d];
                match positions {
                    Some(p) => {
                        let pos = &p[(token % t) * d..][..d];
                        for ((o, &v), &q) in out.iter_mut().zip(row).zip(pos) {
                            o.write(v + q);
                        }
                    }
                    None => {
                        for (o, &v) in out.iter_mut().zip(row) {
                            o.write(v);
                        }
                    }
                }
            })?
        };
        if mode == Mode::Train {
            self.saved_ids = Some(input.clone());
        }
        Ok(out)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let ids = self
            .saved_ids
            .take()
            .ok_or(ModelError::NoSavedActivation { op: "embedding" })?;
        let rows = self.token_rows(&ids)?;
        let (n, t, d) = (ids.shape()[0], ids.shape()[1], self.dim);
        grad_output.expect_shape("embedding backward", &[n, t, d])?;
        let g = grad_output.data();
        if let Some(p) = std::iter::once(&self.table)
            .chain(&self.positions)
            .find(|p| !p.grad_fits())
        {
            return Err(ModelError::State(format!(
                "{} gradient has shape {:?} for a value of {:?}",
                p.name,
                p.grad.shape(),
                p.value.shape()
            )));
        }
        // Frozen tables (fine-tuning) get no gradient: none computed.
        if !self.table.frozen {
            let table_grad = self.table.grad.data_mut();
            for (token, &row) in rows.iter().enumerate() {
                let src = &g[token * d..(token + 1) * d];
                for (acc, &v) in table_grad[row * d..(row + 1) * d].iter_mut().zip(src) {
                    *acc += v;
                }
            }
        }
        if let Some(p) = self.positions.as_mut().filter(|p| !p.frozen) {
            let pos_grad = p.grad.data_mut();
            for (token, src) in g.chunks_exact(d.max(1)).enumerate() {
                let at = (token % t) * d;
                for (acc, &v) in pos_grad[at..at + d].iter_mut().zip(src) {
                    *acc += v;
                }
            }
        }
        Tensor::try_zeros(ids.shape())
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut params = vec![&mut self.table];
        if let Some(p) = &mut self.positions {
            params.push(p);
        }
        params
    }

    fn clear_saved(&mut self) {
        self.saved_ids = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::check_layer;

    fn ids(n: usize, t: usize, vocab: usize) -> Tensor {
        Tensor::try_from_fn(&[n, t], |i| ((i * 7 + 3) % vocab) as f32).unwrap()
    }

    #[test]
    fn looks_up_rows_and_adds_positions() {
        let mut emb = Embedding::new("emb", 5, 3, Some(4), &mut InitRng::new(1));
        let x = ids(2, 4, 5);
        let y = emb.forward(&x, Mode::Eval).unwrap();
        assert_eq!(y.shape(), &[2, 4, 3]);
        let (table, pos) = (emb.table.value.data(), emb.positions.as_ref().unwrap());
        let id = x.data()[6] as usize; // n = 1, t = 2
        for j in 0..3 {
            assert_eq!(
                y.data()[6 * 3 + j],
                table[id * 3 + j] + pos.value.data()[2 * 3 + j]
            );
        }
    }

    #[test]
    fn gradient_matches_finite_differences() {
        for positions in [None, Some(3)] {
            let mut emb = Embedding::new("emb", 4, 5, positions, &mut InitRng::new(2));
            let report = check_layer(&mut emb, &ids(3, 3, 4), 1e-2, 1e-3);
            assert!(report.is_ok(), "{}", report.unwrap_err());
        }
    }

    #[test]
    fn bad_ids_and_long_sequences_are_named_errors() {
        let mut emb = Embedding::new("emb", 4, 2, Some(3), &mut InitRng::new(3));
        let bad = Tensor::from_vec(&[1, 2], vec![1.0, 4.0]).unwrap();
        let err = emb.forward(&bad, Mode::Train).unwrap_err();
        assert!(err.to_string().contains("0..4"), "{err}");
        let negative = Tensor::from_vec(&[1, 1], vec![-1.0]).unwrap();
        assert!(emb.forward(&negative, Mode::Train).is_err());
        let err = emb.forward(&ids(1, 4, 4), Mode::Train).unwrap_err();
        assert!(err.to_string().contains("at most 3 positions"), "{err}");
    }
}
