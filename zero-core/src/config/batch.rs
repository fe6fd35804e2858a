//! The batch triad: `train_batch_size = train_micro_batch_size_per_gpu ×
//! gradient_accumulation_steps × world size`, with DeepSpeed's rules for deriving what is missing.

use super::auto::{Auto, Overrides};
use super::error::ConfigError;
use super::reader::{Cx, Deferred, Section};
use super::scalar::Scalar;
use serde::Serialize;
use serde_json::Value;

const TRAIN: &str = "train_batch_size";
const MICRO: &str = "train_micro_batch_size_per_gpu";
const GAS: &str = "gradient_accumulation_steps";

/// The three batch keys as written: absent, "auto", or a positive integer.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct BatchSpec {
    /// `train_batch_size`: samples per optimizer step, over all ranks.
    pub train_batch_size: Option<Auto<u64>>,
    /// `train_micro_batch_size_per_gpu`: samples per forward/backward on one rank.
    pub train_micro_batch_size_per_gpu: Option<Auto<u64>>,
    /// `gradient_accumulation_steps`: micro-batches per optimizer step.
    pub gradient_accumulation_steps: Option<Auto<u64>>,
}

/// The batch triad, resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BatchSizes {
    /// Samples per optimizer step, over all ranks.
    pub train_batch_size: u64,
    /// Samples per forward/backward on one rank.
    pub micro_batch_size: u64,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation_steps: u64,
}

/// Reads the three keys (each must be "auto" or an integer > 0).
pub(crate) fn read_batch(top: &mut Section<'_>, cx: &mut Cx<'_>) -> Result<BatchSpec, ConfigError> {
    let mut one = |name: &'static str| -> Result<Option<Auto<u64>>, ConfigError> {
        match top.lookup(&[name], cx)? {
            None => Ok(None),
            Some((_, Value::String(s))) if s == "auto" => {
                cx.written_auto.insert(name.to_string());
                Ok(Some(Auto::Auto))
            }
            Some((_, v)) => {
                let n: u64 = cx.convert(name, v)?;
                if n == 0 {
                    return Err(cx.invalid(name, v, "batch sizes and accumulation steps must be > 0"));
                }
                Ok(Some(Auto::Value(n)))
            }
        }
    };
    Ok(BatchSpec {
        train_batch_size: one(TRAIN)?,
        train_micro_batch_size_per_gpu: one(MICRO)?,
        gradient_accumulation_steps: one(GAS)?,
    })
}

/// Resolves the triad for `world` ranks (data-parallel size). "auto" takes the caller's
/// override if there is one, and otherwise is derived like an absent key. With no world size,
/// the checks that do not need it are made, and what needs it is returned as deferred.
pub(crate) fn resolve_batch(
    spec: &BatchSpec,
    world: Option<usize>,
    overrides: &Overrides,
    source: &str,
    defer: bool,
) -> Result<(BatchSizes, Vec<Deferred>), ConfigError> {
    let fill = |name: &str, v: Option<Auto<u64>>| -> Result<Option<u64>, ConfigError> {
        match v {
            Some(Auto::Value(n)) => Ok(Some(n)),
            Some(Auto::Auto) => match overrides.get(name) {
                None => Ok(None),
                Some(o) => match <u64 as Scalar>::from_value(o).filter(|&n| n > 0) {
                    Some(n) => Ok(Some(n)),
                    None => Err(ConfigError::InvalidType {
                        source_name: source.to_string(),
                        key: name.to_string(),
                        expected: "an integer > 0 (override)".into(),
                        found: o.to_string(),
                    }),
                },
            },
            None => Ok(None),
        }
    };
    let train = fill(TRAIN, spec.train_batch_size)?;
    let micro = fill(MICRO, spec.train_micro_batch_size_per_gpu)?;
    let gas = fill(GAS, spec.gradient_accumulation_steps)?;
    let err = |message: String| ConfigError::Batch {
        source_name: source.to_string(),
        message,
    };
    if train.is_none() && micro.is_none() {
        let resolved_by = if spec.train_batch_size.is_some() || spec.train_micro_batch_size_per_gpu.is_some() {
            "the training script"
        } else {
            "nothing: the file gives neither train_batch_size nor train_micro_batch_size_per_gpu"
        };
        if defer {
            let deferred = [TRAIN, MICRO, GAS]
                .iter()
                .map(|k| Deferred {
                    key: k.to_string(),
                    resolved_by: resolved_by.to_string(),
                })
                .collect();
            let stand_in = BatchSizes {
                train_batch_size: 0,
                micro_batch_size: 0,
                gradient_accumulation_steps: 0,
            };
            return Ok((stand_in, deferred));
        }
        return Err(err(format!(
            "{TRAIN} or {MICRO} must be given: write one in the file, as a number, or as \"auto\" with the \
             value supplied when the run starts (on the command line, `--set {MICRO}=N`){}",
            if gas.is_some() {
                format!("; {GAS} alone is not enough")
            } else {
                String::new()
            }
        )));
    }
    let Some(world) = world.map(|w| w as u64) else {
        return without_world(train, micro, gas, &err);
    };
    if world == 0 {
        return Err(err("the world size must be > 0".into()));
    }
    let sizes = match (train, micro, gas) {
        (Some(t), Some(m), Some(g)) => {
            let product = product(&[(MICRO, m), (GAS, g), ("data-parallel world size", world)], &err)?;
            if t != product {
                return Err(err(format!(
                    "{TRAIN} = {t} but {MICRO} ({m}) × {GAS} ({g}) × data-parallel world size ({world}) = {product}; \
                     set {TRAIN} to {product}, or change {MICRO} or {GAS} so that the product is {t}, \
                     or drop one of the three to have it derived"
                )));
            }
            (t, m, g)
        }
        (Some(t), Some(m), None) => (
            t,
            m,
            divide(
                t,
                product(&[(MICRO, m), ("data-parallel world size", world)], &err)?,
                TRAIN,
                &format!("{MICRO} ({m}) × data-parallel world size ({world})"),
                GAS,
                &err,
            )?,
        ),
        (Some(t), None, Some(g)) => (
            t,
            divide(
                t,
                product(&[(GAS, g), ("data-parallel world size", world)], &err)?,
                TRAIN,
                &format!("{GAS} ({g}) × data-parallel world size ({world})"),
                MICRO,
                &err,
            )?,
            g,
        ),
        (None, Some(m), Some(g)) => (
            product(&[(MICRO, m), (GAS, g), ("data-parallel world size", world)], &err)?,
            m,
            g,
        ),
        (Some(t), None, None) => (
            t,
            divide(
                t,
                world,
                TRAIN,
                &format!("the data-parallel world size ({world})"),
                MICRO,
                &err,
            )?,
            1,
        ),
        (None, Some(m), None) => (product(&[(MICRO, m), ("data-parallel world size", world)], &err)?, m, 1),
        (None, None, _) => unreachable!("checked above"),
    };
    Ok((
        BatchSizes {
            train_batch_size: sizes.0,
            micro_batch_size: sizes.1,
            gradient_accumulation_steps: sizes.2,
        },
        Vec::new(),
    ))
}

/// The product of batch values, or an error naming them when it does not fit 64 bits.
fn product(factors: &[(&str, u64)], err: &dyn Fn(String) -> ConfigError) -> Result<u64, ConfigError> {
    factors
        .iter()
        .try_fold(1u64, |acc, &(_, v)| acc.checked_mul(v))
        .ok_or_else(|| {
            let named: Vec<String> = factors.iter().map(|(name, v)| format!("{name} ({v})")).collect();
            err(format!(
                "{} does not fit a 64-bit count; lower {}",
                named.join(" × "),
                factors[0].0
            ))
        })
}

/// `numerator / denominator` when exact and > 0, else an error saying what to change.
fn divide(
    numerator: u64,
    denominator: u64,
    numerator_key: &str,
    denominator_text: &str,
    derived_key: &str,
    err: &dyn Fn(String) -> ConfigError,
) -> Result<u64, ConfigError> {
    // `%` rather than is_multiple_of: the workspace supports Rust 1.85.
    #[allow(clippy::manual_is_multiple_of)]
    let exact = numerator % denominator == 0;
    if !exact || numerator < denominator {
        return Err(err(format!(
            "{numerator_key} = {numerator} is not a positive multiple of {denominator_text} = \
             {denominator}, so {derived_key} cannot be derived; set {numerator_key} to a multiple \
             of {denominator} (e.g. {}) or give {derived_key} explicitly",
            (numerator / denominator).max(1) * denominator
        )));
    }
    Ok(numerator / denominator)
}

/// Without a world size: all three given fixes the world size (it must divide exactly);
/// anything else waits for the world size.
fn without_world(
    train: Option<u64>,
    micro: Option<u64>,
    gas: Option<u64>,
    err: &dyn Fn(String) -> ConfigError,
) -> Result<(BatchSizes, Vec<Deferred>), ConfigError> {
    if let (Some(t), Some(m), Some(g)) = (train, micro, gas) {
        let per_rank = product(&[(MICRO, m), (GAS, g)], err)?;
        if t % per_rank != 0 {
            return Err(err(format!(
                "{TRAIN} = {t} is not a multiple of {MICRO} ({m}) × {GAS} ({g}) = {per_rank}, so no \
                 world size fits; change one of the three"
            )));
        }
        let sizes = BatchSizes {
            train_batch_size: t,
            micro_batch_size: m,
            gradient_accumulation_steps: g,
        };
        let implied = Deferred {
            key: "world_size".into(),
            resolved_by: format!("the batch triad implies a world size of {}", t / per_rank),
        };
        return Ok((sizes, vec![implied]));
    }
    let needs = "the other batch keys and the world size (--world-size)";
    let mut deferred = Vec::new();
    for (key, v) in [(TRAIN, train), (MICRO, micro), (GAS, gas)] {
        if v.is_none() {
            deferred.push(Deferred {
                key: key.into(),
                resolved_by: needs.into(),
            });
        }
    }
    let sizes = BatchSizes {
        train_batch_size: train.unwrap_or(0),
        micro_batch_size: micro.unwrap_or(0),
        gradient_accumulation_steps: gas.unwrap_or(if train.is_some() && micro.is_some() { 0 } else { 1 }),
    };
    Ok((sizes, deferred))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(t: Option<u64>, m: Option<u64>, g: Option<u64>) -> BatchSpec {
        BatchSpec {
            train_batch_size: t.map(Auto::Value),
            train_micro_batch_size_per_gpu: m.map(Auto::Value),
            gradient_accumulation_steps: g.map(Auto::Value),
        }
    }

    fn run(t: Option<u64>, m: Option<u64>, g: Option<u64>, world: usize) -> Result<(u64, u64, u64), String> {
        resolve_batch(&spec(t, m, g), Some(world), &Overrides::new(), "f.json", false)
            .map(|(b, _)| (b.train_batch_size, b.micro_batch_size, b.gradient_accumulation_steps))
            .map_err(|e| e.to_string())
    }

    // Reference: DeepSpeed's _set_batch_related_parameters and _batch_assertion, applied by hand.
    #[test]
    fn deepspeed_inference_rules() {
        assert_eq!(run(Some(32), Some(4), Some(2), 4), Ok((32, 4, 2)));
        assert_eq!(run(Some(32), Some(4), None, 4), Ok((32, 4, 2)));
        assert_eq!(run(Some(32), None, Some(2), 4), Ok((32, 4, 2)));
        assert_eq!(run(None, Some(4), Some(2), 4), Ok((32, 4, 2)));
        assert_eq!(run(Some(32), None, None, 4), Ok((32, 8, 1)));
        assert_eq!(run(None, Some(4), None, 4), Ok((16, 4, 1)));
    }

    #[test]
    fn mismatch_names_all_values_and_the_fix() {
        let e = run(Some(32), Some(4), Some(2), 2).unwrap_err();
        for part in [
            "train_batch_size = 32",
            "(4)",
            "(2)",
            "world size (2)",
            "= 16",
            "set train_batch_size to 16",
        ] {
            assert!(e.contains(part), "{part} missing in: {e}");
        }
    }

    #[test]
    fn products_that_overflow_are_errors_naming_the_keys() {
        let huge = Some(1u64 << 40);
        for (t, m, g) in [(None, huge, huge), (Some(8), huge, huge), (Some(8), huge, None)] {
            let e = run(t, m, g, 1 << 30).unwrap_err();
            assert!(e.contains(MICRO) && e.contains("64-bit"), "{e}");
        }
        let e = resolve_batch(&spec(Some(8), huge, huge), None, &Overrides::new(), "f", true).unwrap_err();
        assert!(e.to_string().contains(GAS), "{e}");
    }

    #[test]
    fn indivisible_derivations_are_errors() {
        let e = run(Some(30), Some(4), None, 2).unwrap_err();
        assert!(e.contains("gradient_accumulation_steps cannot be derived"), "{e}");
        assert!(run(Some(2), None, None, 4).is_err(), "train < world would give micro 0");
    }

    #[test]
    fn none_or_only_gas_is_an_error() {
        assert!(run(None, None, None, 1).unwrap_err().contains("must be given"));
        assert!(run(None, None, Some(4), 1).is_err());
        // At parse time (deferring), a missing triad is left for initialize, where it fails.
        let (_, d) = resolve_batch(&spec(None, None, None), None, &Overrides::new(), "f", true).unwrap();
        assert_eq!(d.len(), 3);
        assert!(d[0].resolved_by.contains("neither"));
    }

    #[test]
    fn auto_uses_override_or_is_derived() {
        let s = BatchSpec {
            train_batch_size: Some(Auto::Auto),
            train_micro_batch_size_per_gpu: Some(Auto::Auto),
            gradient_accumulation_steps: Some(Auto::Auto),
        };
        let o = Overrides::new().with(MICRO, 8).with(GAS, 2);
        let (b, _) = resolve_batch(&s, Some(2), &o, "f", false).unwrap();
        assert_eq!(
            (b.train_batch_size, b.micro_batch_size, b.gradient_accumulation_steps),
            (32, 8, 2)
        );
        assert!(resolve_batch(&s, Some(2), &Overrides::new(), "f", false).is_err());
    }

    #[test]
    fn without_world_size_the_needed_keys_are_deferred() {
        let (_, d) = resolve_batch(&spec(None, Some(4), None), None, &Overrides::new(), "f", true).unwrap();
        let keys: Vec<_> = d.iter().map(|d| d.key.as_str()).collect();
        assert_eq!(keys, [TRAIN, GAS]);
        let (b, d) = resolve_batch(&spec(Some(64), Some(4), Some(2)), None, &Overrides::new(), "f", true).unwrap();
        assert_eq!(b.train_batch_size, 64);
        assert!(d[0].resolved_by.contains("world size of 8"));
        assert!(resolve_batch(&spec(Some(63), Some(4), Some(2)), None, &Overrides::new(), "f", true,).is_err());
    }
}
