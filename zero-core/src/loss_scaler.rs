//! Loss scaling for fp16 training, with DeepSpeed's dynamic loss scaler semantics.
//!
//! fp16 gradients underflow unless the loss is multiplied by a large factor before backward.
//! The dynamic scaler starts high (2^initial_scale_power), halves the scale when a step's
//! gradients overflow (after `hysteresis` tolerated overflows), and doubles it after
//! `loss_scale_window` steps without one. A step whose gradients overflowed is skipped. A static
//! scale (`loss_scale > 0`) never changes; overflowed steps are still skipped, as ZeRO does.
//!
//! ```
//! use zero_core::loss_scaler::{LossScaler, LossScalerConfig, ScaleDecision};
//!
//! let mut scaler = LossScaler::new(LossScalerConfig { hysteresis: 1, ..Default::default() }).unwrap();
//! assert_eq!(scaler.scale(), 65536.0);
//! assert_eq!(scaler.update(true).unwrap(), ScaleDecision::Skip);
//! assert_eq!(scaler.scale(), 32768.0);
//! ```

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// The `fp16` section's loss-scaling keys, with DeepSpeed's defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LossScalerConfig {
    /// A fixed scale; 0 selects dynamic scaling. Default 0.
    pub loss_scale: f64,
    /// The dynamic scale starts at 2^this. Default 16.
    pub initial_scale_power: u32,
    /// Overflow-free steps after which the scale doubles. Default 1000.
    pub loss_scale_window: u64,
    /// Overflows tolerated before the scale is halved. Default 2.
    pub hysteresis: u32,
    /// Refill the hysteresis after every overflow-free step (instead of only when the scale
    /// grows). Default false.
    pub consecutive_hysteresis: bool,
    /// The scale is never halved below this. Default 1.
    pub min_loss_scale: f64,
}

impl Default for LossScalerConfig {
    fn default() -> Self {
        LossScalerConfig {
            loss_scale: 0.0,
            initial_scale_power: 16,
            loss_scale_window: 1000,
            hysteresis: 2,
            consecutive_hysteresis: false,
            min_loss_scale: 1.0,
        }
    }
}

/// What to do with the step whose gradients were just checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleDecision {
    /// The gradients are finite: unscale them and step.
    Apply,
    /// The gradients overflowed: drop them, do not step, do not advance the LR schedule.
    Skip,
}

/// A loss-scaling failure.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LossScaleError {
    /// The gradients overflowed with the scale already at `min_loss_scale`.
    #[error(
        "gradient overflow at step {step} with the loss scale already at its minimum ({scale}): \
         fp16 training cannot go on. The model's values exceed fp16's range; train in bf16 \
         instead (\"bf16\": {{\"enabled\": true}}, no loss scaling needed), or lower the \
         learning rate or min_loss_scale"
    )]
    OverflowAtMinimumScale {
        /// The scaler's iteration (updates so far, skipped ones included).
        step: u64,
        /// The scale that overflowed.
        scale: f64,
    },
    /// A setting is out of range.
    #[error("invalid fp16 setting `{name}` = {value}: {reason}")]
    InvalidSetting {
        /// The config key.
        name: &'static str,
        /// The value given.
        value: f64,
        /// The valid range.
        reason: &'static str,
    },
}

/// The scaler's state, as a checkpoint stores it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScalerState {
    /// The current scale.
    pub cur_scale: f64,
    /// Updates so far.
    pub cur_iter: u64,
    /// The iteration of the last overflow, -1 if none.
    pub last_overflow_iter: i64,
    /// Overflows still tolerated before the next halving.
    pub cur_hysteresis: u32,
    /// Steps skipped for overflow so far.
    pub skipped_steps: u64,
}

/// DeepSpeed's loss scaler (dynamic or static).
#[derive(Clone, Debug, PartialEq)]
pub struct LossScaler {
    config: LossScalerConfig,
    dynamic: bool,
    state: LossScalerState,
}

/// The factor the dynamic scale moves by.
const SCALE_FACTOR: f64 = 2.0;

impl LossScaler {
    /// A scaler at its start.
    pub fn new(config: LossScalerConfig) -> Result<Self, LossScaleError> {
        let invalid = |name, value: f64, reason| LossScaleError::InvalidSetting { name, value, reason };
        // Scales multiply and divide f32 values: one f32 cannot hold (0 there, or infinite)
        // turns every gradient into NaN.
        let f32_scale = |s: f64| (f32::MIN_POSITIVE as f64..=f32::MAX as f64).contains(&s);
        if !(config.loss_scale == 0.0 || f32_scale(config.loss_scale)) {
            return Err(invalid(
                "loss_scale",
                config.loss_scale,
                "must be 0 (dynamic) or a scale from 1.2e-38 to 3.4e38 (an f32's normal range)",
            ));
        }
        if !f32_scale(config.min_loss_scale) {
            return Err(invalid(
                "min_loss_scale",
                config.min_loss_scale,
                "must be from 1.2e-38 to 3.4e38 (an f32's normal range)",
            ));
        }
        if config.loss_scale_window == 0 {
            return Err(invalid("loss_scale_window", 0.0, "must be at least 1"));
        }
        if config.hysteresis == 0 {
            return Err(invalid("hysteresis", 0.0, "must be at least 1"));
        }
        if config.initial_scale_power > 127 {
            return Err(invalid(
                "initial_scale_power",
                config.initial_scale_power as f64,
                "2^power must be a finite f32 (power <= 127)",
            ));
        }
        let dynamic = config.loss_scale == 0.0;
        let cur_scale = if dynamic {
            2f64.powi(config.initial_scale_power as i32)
        } else {
            config.loss_scale
        };
        Ok(LossScaler {
            dynamic,
            state: LossScalerState {
                cur_scale,
                cur_iter: 0,
                last_overflow_iter: -1,
                cur_hysteresis: config.hysteresis,
                skipped_steps: 0,
            },
            config,
        })
    }

    /// The scale to multiply the loss by.
    pub fn scale(&self) -> f64 {
        self.state.cur_scale
    }

    /// Whether the scale adapts to overflows.
    pub fn is_dynamic(&self) -> bool {
        self.dynamic
    }

    /// Steps skipped for overflow so far.
    pub fn skipped_steps(&self) -> u64 {
        self.state.skipped_steps
    }

    /// Records whether this step's gradients overflowed (on any rank: the caller reduces the
    /// flag first) and adapts the scale. Fails when an overflow would take a dynamic scale
    /// below `min_loss_scale`.
    pub fn update(&mut self, overflow: bool) -> Result<ScaleDecision, LossScaleError> {
        let s = &mut self.state;
        if !self.dynamic {
            s.cur_iter += 1;
            if overflow {
                s.skipped_steps += 1;
                return Ok(ScaleDecision::Skip);
            }
            return Ok(ScaleDecision::Apply);
        }
        let hysteresis = self.config.hysteresis;
        let decision = if overflow {
            if hysteresis == 1 || s.cur_hysteresis == 1 {
                if s.cur_scale == self.config.min_loss_scale {
                    return Err(LossScaleError::OverflowAtMinimumScale {
                        step: s.cur_iter,
                        scale: s.cur_scale,
                    });
                }
                s.cur_scale = (s.cur_scale / SCALE_FACTOR).max(self.config.min_loss_scale);
            } else {
                s.cur_hysteresis -= 1;
            }
            s.last_overflow_iter = s.cur_iter as i64;
            s.skipped_steps += 1;
            ScaleDecision::Skip
        } else {
            if self.config.consecutive_hysteresis {
                s.cur_hysteresis = hysteresis;
            }
            let stable = s.cur_iter as i64 - s.last_overflow_iter - 1;
            if stable > 0 && (stable as u64).is_multiple_of(self.config.loss_scale_window) {
                if !self.config.consecutive_hysteresis {
                    s.cur_hysteresis = hysteresis;
                }
                s.cur_scale *= SCALE_FACTOR;
            }
            ScaleDecision::Apply
        };
        s.cur_iter += 1;
        Ok(decision)
    }

    /// The state to checkpoint.
    pub fn state(&self) -> LossScalerState {
        self.state
    }

    /// Restores a checkpointed state.
    pub fn load_state(&mut self, state: LossScalerState) {
        self.state = state;
    }
}

/// Elements per parallel chunk of the overflow scan.
const SCAN_CHUNK: usize = 1 << 16;

/// Whether any value is infinite or NaN. Scans in parallel, on AVX2 where the CPU has it.
pub fn has_overflow(values: &[f32]) -> bool {
    if values.len() <= SCAN_CHUNK {
        return chunk_has_overflow(values);
    }
    values.par_chunks(SCAN_CHUNK).any(chunk_has_overflow)
}

fn chunk_has_overflow(values: &[f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected at run time just above.
        return unsafe { max_magnitude_bits_avx2(values) } >= INF_BITS;
    }
    max_magnitude_bits(values) >= INF_BITS
}

/// The bits of +inf: every non-finite f32 has magnitude bits at or above them.
const INF_BITS: u32 = 0x7F80_0000;

/// The largest `bits & 0x7FFF_FFFF` (the magnitude, ordered like the value for finite floats,
/// above `INF_BITS` for NaN). Written as eight independent lanes, without an early exit, so
/// the compiler turns it into vector code.
#[inline(always)]
fn max_magnitude_bits(values: &[f32]) -> u32 {
    let mut lanes = [0u32; 8];
    let chunks = values.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (lane, &x) in lanes.iter_mut().zip(c) {
            *lane = (*lane).max(x.to_bits() & 0x7FFF_FFFF);
        }
    }
    let tail_max = tail.iter().map(|x| x.to_bits() & 0x7FFF_FFFF).max().unwrap_or(0);
    lanes.into_iter().max().unwrap_or(0).max(tail_max)
}

/// [`max_magnitude_bits`] compiled for AVX2 (eight u32 lanes in one register).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn max_magnitude_bits_avx2(values: &[f32]) -> u32 {
    max_magnitude_bits(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A NaN or infinity at any position of any length is found; finite extremes are not.
    #[test]
    fn overflow_scan_finds_every_non_finite_value() {
        for n in [1usize, 7, 8, 9, 64, 1000, 200_000] {
            let mut v: Vec<f32> = (0..n).map(|i| (i as f32).sin() * 1e4).collect();
            v[n / 2] = f32::MAX;
            v[0] = -f32::MAX;
            assert!(!has_overflow(&v), "n={n}: finite values flagged");
            for pos in [0, n / 3, n - 1] {
                for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN] {
                    let mut w = v.clone();
                    w[pos] = bad;
                    assert!(has_overflow(&w), "n={n}: {bad} at {pos} missed");
                }
            }
        }
        assert!(!has_overflow(&[]));
    }

    /// The portable scan and the AVX2 build of it agree (the public scan only runs the latter
    /// on CPUs that have AVX2).
    #[test]
    fn portable_and_avx2_scans_agree() {
        let mut v: Vec<f32> = (0..1003).map(|i| i as f32 - 500.0).collect();
        assert!(max_magnitude_bits(&v) < INF_BITS);
        v[1001] = f32::NAN;
        assert!(max_magnitude_bits(&v) >= INF_BITS);
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was detected just above.
            assert_eq!(unsafe { max_magnitude_bits_avx2(&v) }, max_magnitude_bits(&v));
            v[1001] = 3.0;
            assert_eq!(unsafe { max_magnitude_bits_avx2(&v) }, max_magnitude_bits(&v));
        }
    }

    #[test]
    fn static_scale_never_moves_but_overflowed_steps_are_skipped() {
        let mut s = LossScaler::new(LossScalerConfig {
            loss_scale: 128.0,
            ..Default::default()
        })
        .unwrap();
        assert!(!s.is_dynamic());
        assert_eq!(s.update(true).unwrap(), ScaleDecision::Skip);
        for _ in 0..3000 {
            assert_eq!(s.update(false).unwrap(), ScaleDecision::Apply);
        }
        assert_eq!(s.scale(), 128.0);
        assert_eq!(s.skipped_steps(), 1);
    }

    #[test]
    fn overflow_at_the_minimum_scale_is_an_error_that_suggests_bf16() {
        let mut s = LossScaler::new(LossScalerConfig {
            initial_scale_power: 1,
            hysteresis: 1,
            min_loss_scale: 1.0,
            ..Default::default()
        })
        .unwrap();
        s.update(false).unwrap();
        assert_eq!(s.update(true).unwrap(), ScaleDecision::Skip);
        assert_eq!(s.scale(), 1.0);
        let err = s.update(true).unwrap_err();
        assert_eq!(err, LossScaleError::OverflowAtMinimumScale { step: 2, scale: 1.0 });
        let text = err.to_string();
        assert!(text.contains("step 2") && text.contains("bf16"), "{text}");
    }

    #[test]
    fn bad_settings_are_refused() {
        for cfg in [
            LossScalerConfig {
                loss_scale: -1.0,
                ..Default::default()
            },
            LossScalerConfig {
                min_loss_scale: 0.0,
                ..Default::default()
            },
            LossScalerConfig {
                loss_scale_window: 0,
                ..Default::default()
            },
            LossScalerConfig {
                hysteresis: 0,
                ..Default::default()
            },
        ] {
            assert!(LossScaler::new(cfg).is_err());
        }
    }
}
