//! Greedy and top-p generation with the KV cache: the prompt runs once, then
//! each step runs one token. Sampling draws from a counter-free xorshift
//! generator seeded by the caller, so a (seed, prompt) pair always gives the
//! same text. Memory: the cache (see forward.rs) and one vocabulary of
//! probabilities per step.

use crate::error::{LlmError, Result};
use crate::forward::{KvCache, Want};
use crate::model::Model;

/// How the next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sampling {
    /// The most likely token (the first of equals, as torch's argmax).
    Greedy,
    /// Nucleus sampling: logits / temperature, then a draw from the
    /// smallest set of most likely tokens whose probability reaches `top_p`.
    TopP {
        temperature: f32,
        top_p: f32,
        seed: u64,
    },
}

/// The state of a seeded draw (splitmix64: small, and good enough to pick
/// a token).
struct Rng(u64);

impl Rng {
    fn next_f64(&mut self) -> f64 {
        let z = crate::math::splitmix64(&mut self.0);
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Index of the largest value (the first of equals).
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best
}

fn top_p(logits: &[f32], temperature: f32, p: f32, rng: &mut Rng) -> usize {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &v)| (i, (((v - max) / temperature) as f64).exp()))
        .collect();
    let sum: f64 = probs.iter().map(|(_, q)| q).sum();
    // Most likely first; ties by id, so the order is a function of the logits.
    probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut kept = 0;
    let mut mass = 0.0;
    for (_, q) in &probs {
        kept += 1;
        mass += q / sum;
        if mass >= p as f64 {
            break;
        }
    }
    let kept = &probs[..kept];
    let total: f64 = kept.iter().map(|(_, q)| q).sum();
    let mut target = rng.next_f64() * total;
    for &(i, q) in kept {
        if target < q {
            return i;
        }
        target -= q;
    }
    kept[kept.len() - 1].0
}

impl Model {
    /// Up to `max_new_tokens` tokens after `prompt`, stopping after an
    /// end-of-sequence token of the config (which is returned).
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new_tokens: usize,
        sampling: Sampling,
    ) -> Result<Vec<u32>> {
        if prompt.is_empty() {
            return Err(LlmError::Input("the prompt encodes to no tokens".into()));
        }
        if let Sampling::TopP {
            temperature, top_p, ..
        } = sampling
        {
            if !(temperature > 0.0 && temperature.is_finite()) {
                return Err(LlmError::Input(format!(
                    "temperature {temperature}: expected a positive number"
                )));
            }
            if !(top_p > 0.0 && top_p <= 1.0) {
                return Err(LlmError::Input(format!(
                    "top-p {top_p}: expected 0 < p <= 1"
                )));
            }
        }
        let mut rng = Rng(match sampling {
            Sampling::TopP { seed, .. } => seed,
            Sampling::Greedy => 0,
        });
        let mut cache = KvCache::new(self, 1);
        let mut out = Vec::new();
        let mut next_input = prompt.to_vec();
        for _ in 0..max_new_tokens {
            if let Some(max) = self.config.max_positions {
                if cache.len() + next_input.len() > max {
                    break;
                }
            }
            let logits = self.forward(&[next_input], &mut cache, Want::Last)?;
            let token = match sampling {
                Sampling::Greedy => argmax(&logits),
                Sampling::TopP {
                    temperature,
                    top_p: p,
                    ..
                } => top_p(&logits, temperature, p, &mut rng),
            } as u32;
            out.push(token);
            if self.config.eos_token_ids.contains(&token) {
                break;
            }
            next_input = vec![token];
        }
        Ok(out)
    }
}
