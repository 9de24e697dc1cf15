//! Linear regression by SGD on a synthetic, reproducible data set: sample `k` of stream `s` is
//! a pure function of (seed, s, k), so a trainer that resumes at a checkpointed offset sees
//! exactly the samples it had not seen yet.

/// SplitMix64: tiny, fast, good enough for synthetic data, and the same on every machine.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }
}

/// The model the data is drawn from: what training should find.
pub fn true_weights(seed: u64, dim: usize) -> Vec<f64> {
    let mut rng = Rng::new(seed ^ 0x5EED_0000_0000_0001);
    (0..dim).map(|_| 2.0 * rng.next_f64()).collect()
}

/// Sample `index` of stream `stream`: features in [-1, 1) and `y = w·x + noise` (noise ±0.01).
pub fn sample(seed: u64, truth: &[f64], stream: u64, index: u64) -> (Vec<f64>, f64) {
    let mut rng =
        Rng::new(seed ^ stream.wrapping_mul(0xA24B_AED4_963E_E407) ^ index.wrapping_mul(0x9FB2_1C65_1E98_DF25));
    let x: Vec<f64> = truth.iter().map(|_| rng.next_f64()).collect();
    let y = dot(truth, &x) + 0.01 * rng.next_f64();
    (x, y)
}

pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(a, b)| a * b).sum()
}

/// Half the mean squared error of `w` on the batch and its gradient.
pub fn loss_and_gradient(w: &[f64], batch: &[(Vec<f64>, f64)]) -> (f64, Vec<f64>) {
    let mut grad = vec![0.0; w.len()];
    let mut loss = 0.0;
    for (x, y) in batch {
        let err = dot(w, x) - y;
        loss += 0.5 * err * err;
        for (g, xi) in grad.iter_mut().zip(x) {
            *g += err * xi;
        }
    }
    let n = batch.len().max(1) as f64;
    grad.iter_mut().for_each(|g| *g /= n);
    (loss / n, grad)
}

/// `w -= lr * grad`.
pub fn apply(w: &mut [f64], lr: f64, grad: &[f64]) {
    for (wi, gi) in w.iter_mut().zip(grad) {
        *wi -= lr * gi;
    }
}

/// The slice of a `dim`-vector parameter server `index` of `count` holds.
pub fn shard(dim: usize, count: usize, index: usize) -> std::ops::Range<usize> {
    let per = dim.div_ceil(count.max(1));
    (index * per).min(dim)..((index + 1) * per).min(dim)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_reproducible_and_streams_differ() {
        let truth = true_weights(7, 4);
        assert_eq!(sample(7, &truth, 0, 5), sample(7, &truth, 0, 5));
        assert_ne!(sample(7, &truth, 0, 5).0, sample(7, &truth, 1, 5).0);
        assert_ne!(sample(7, &truth, 0, 5).0, sample(7, &truth, 0, 6).0);
    }

    #[test]
    fn the_gradient_is_the_derivative_of_the_loss() {
        let truth = true_weights(1, 3);
        let batch: Vec<_> = (0..8).map(|k| sample(1, &truth, 0, k)).collect();
        let w = vec![0.3, -0.2, 0.1];
        let (l0, g) = loss_and_gradient(&w, &batch);
        for i in 0..3 {
            let mut w2 = w.clone();
            w2[i] += 1e-6;
            let numeric = (loss_and_gradient(&w2, &batch).0 - l0) / 1e-6;
            assert!((numeric - g[i]).abs() < 1e-4, "dim {i}: {numeric} vs {}", g[i]);
        }
    }

    #[test]
    fn sgd_finds_the_true_weights() {
        let truth = true_weights(42, 8);
        let mut w = vec![0.0; 8];
        let first = loss_and_gradient(&w, &(0..32).map(|k| sample(42, &truth, 0, k)).collect::<Vec<_>>()).0;
        let mut last = first;
        for step in 0..300u64 {
            let batch: Vec<_> = (0..32).map(|k| sample(42, &truth, 0, step * 32 + k)).collect();
            let (loss, g) = loss_and_gradient(&w, &batch);
            apply(&mut w, 0.3, &g);
            last = loss;
        }
        assert!(last < first / 100.0, "loss {first} -> {last}");
        for (a, b) in w.iter().zip(&truth) {
            assert!((a - b).abs() < 0.05, "{w:?} vs {truth:?}");
        }
    }

    #[test]
    fn shards_cover_the_vector_once() {
        assert_eq!((shard(16, 2, 0), shard(16, 2, 1)), (0..8, 8..16));
        assert_eq!((shard(5, 2, 0), shard(5, 2, 1)), (0..3, 3..5));
        assert_eq!(shard(1, 2, 1), 1..1);
    }
}
