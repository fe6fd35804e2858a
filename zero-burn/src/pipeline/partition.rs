//! Cutting a list of layers into contiguous stages (DeepSpeed's `partition_method`).

use crate::error::ZeroError;
use std::ops::Range;

/// How the layers are shared among the stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PartitionMethod {
    /// The same number of layers per stage (the first stages take one more when it does not
    /// divide): DeepSpeed's `"uniform"`.
    Uniform,
    /// Contiguous runs whose largest parameter count is as small as it can be: DeepSpeed's
    /// `"parameters"`.
    #[default]
    Parameters,
}

impl PartitionMethod {
    /// The method from DeepSpeed's name (`"uniform"`, `"parameters"`, case-insensitive).
    pub fn from_name(name: &str) -> Result<Self, ZeroError> {
        match name.to_ascii_lowercase().as_str() {
            "uniform" => Ok(PartitionMethod::Uniform),
            "parameters" => Ok(PartitionMethod::Parameters),
            other => Err(ZeroError::Config(format!(
                "partition_method \"{other}\" is not available; choose \"uniform\" or \"parameters\""
            ))),
        }
    }
}

/// The layer range of every stage, for layers with `sizes` parameter elements each. Every stage
/// gets at least one layer.
pub fn partition_layers(
    sizes: &[usize],
    stages: usize,
    method: PartitionMethod,
) -> Result<Vec<Range<usize>>, ZeroError> {
    let n = sizes.len();
    if stages == 0 || n < stages {
        return Err(ZeroError::Model(format!(
            "{n} layers cannot be cut into {stages} pipeline stages (each stage needs at least one layer)"
        )));
    }
    let bounds = match method {
        PartitionMethod::Uniform => {
            let (base, extra) = (n / stages, n % stages);
            let mut bounds = vec![0];
            for s in 0..stages {
                let last = bounds[s];
                bounds.push(last + base + usize::from(s < extra));
            }
            bounds
        }
        PartitionMethod::Parameters => balanced(sizes, stages),
    };
    Ok(bounds.windows(2).map(|w| w[0]..w[1]).collect())
}

/// Stage boundaries minimising the largest stage's sum (ties: the earliest cut), by dynamic
/// programming over (layers, stages); pipelines have tens of layers, so O(n² · stages) is fine.
fn balanced(sizes: &[usize], stages: usize) -> Vec<usize> {
    let n = sizes.len();
    let mut prefix = vec![0u128; n + 1];
    for (i, &s) in sizes.iter().enumerate() {
        prefix[i + 1] = prefix[i] + s as u128;
    }
    // best[k][i]: the smallest possible largest sum of the first i layers in k stages.
    let mut best = vec![vec![u128::MAX; n + 1]; stages + 1];
    let mut cut = vec![vec![0usize; n + 1]; stages + 1];
    best[0][0] = 0;
    for k in 1..=stages {
        for i in k..=n {
            for j in (k - 1)..i {
                if best[k - 1][j] == u128::MAX {
                    continue;
                }
                let load = best[k - 1][j].max(prefix[i] - prefix[j]);
                if load < best[k][i] {
                    best[k][i] = load;
                    cut[k][i] = j;
                }
            }
        }
    }
    let mut bounds = vec![n];
    let mut i = n;
    for k in (1..=stages).rev() {
        i = cut[k][i];
        bounds.push(i);
    }
    bounds.reverse();
    bounds
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_gives_the_first_stages_the_remainder() {
        let r = partition_layers(&[1; 7], 3, PartitionMethod::Uniform).unwrap();
        assert_eq!(r, vec![0..3, 3..5, 5..7]);
    }

    /// Reference: every contiguous cut enumerated by hand for 5 layers into 2 stages.
    #[test]
    fn parameters_minimise_the_largest_stage() {
        // An embedding-heavy model: a big first and last layer, small blocks.
        let sizes = [100, 10, 10, 10, 100];
        let r = partition_layers(&sizes, 2, PartitionMethod::Parameters).unwrap();
        // Cuts: [100|...]=130, [110|120]=120, [120|110]=120, [130|100]=130 → first of the best.
        assert_eq!(r, vec![0..2, 2..5]);
        let r = partition_layers(&sizes, 3, PartitionMethod::Parameters).unwrap();
        assert_eq!(r, vec![0..1, 1..4, 4..5]);
    }

    #[test]
    fn too_few_layers_is_an_error() {
        assert!(partition_layers(&[1, 2], 3, PartitionMethod::Uniform).is_err());
        assert!(PartitionMethod::from_name("type:transformer").is_err());
        assert_eq!(PartitionMethod::from_name("Uniform").unwrap(), PartitionMethod::Uniform);
    }
}
