//! Weight initialisation from a small deterministic generator, so the same
//! seed gives the same network on every machine and every build.

/// SplitMix64: tiny, fast and good enough to draw initial weights.
#[derive(Clone, Debug)]
pub struct InitRng(u64);

impl InitRng {
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in the open interval (0, 1).
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Standard normal by Box-Muller.
    pub fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Normal with standard deviation `std`, redrawn outside two deviations.
    pub fn truncated_normal(&mut self, std: f64) -> f32 {
        loop {
            let z = self.normal();
            if z.abs() <= 2.0 {
                return (z * std) as f32;
            }
        }
    }
}

/// He (Kaiming) initialisation for a layer followed by ReLU: truncated normal
/// with std sqrt(2 / fan_in), corrected for the truncation's variance loss.
pub fn he_truncated(rng: &mut InitRng, fan_in: usize, len: usize) -> Vec<f32> {
    // A normal truncated at ±2σ keeps 0.7737 of its variance.
    const TRUNCATION_STD: f64 = 0.879_625_7;
    let std = (2.0 / fan_in as f64).sqrt() / TRUNCATION_STD;
    (0..len).map(|_| rng.truncated_normal(std)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn he_init_has_the_intended_variance() {
        let mut rng = InitRng::new(7);
        let w = he_truncated(&mut rng, 50, 200_000);
        let var = w.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / w.len() as f64;
        assert!((var - 2.0 / 50.0).abs() < 0.002, "variance {var}");
        let limit = 2.0 * (2.0f64 / 50.0).sqrt() / 0.879_625_7;
        assert!(w.iter().all(|&x| (x as f64).abs() <= limit + 1e-6));
    }

    #[test]
    fn same_seed_same_weights() {
        let a = he_truncated(&mut InitRng::new(1), 9, 100);
        let b = he_truncated(&mut InitRng::new(1), 9, 100);
        let c = he_truncated(&mut InitRng::new(2), 9, 100);
        assert_eq!(a, b);
        assert_ne!(a, c);
    }
}
