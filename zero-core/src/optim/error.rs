//! What can go wrong when an optimizer is built, stepped or restored.

/// An optimizer error. Each variant says which buffer, parameter or setting is at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OptimError {
    /// A slice handed to `step` does not match the shard the optimizer was built for.
    #[error("{what} has {actual} elements but the optimizer shard has {expected}")]
    LengthMismatch {
        /// Which slice (`params`, `grads`, `exp_avg` in a checkpoint, ...).
        what: String,
        /// The shard length the optimizer was built for.
        expected: usize,
        /// The length that was passed.
        actual: usize,
    },
    /// A hyper-parameter is outside its valid range.
    #[error("invalid optimizer setting `{name}` = {value}: {reason}")]
    InvalidSetting {
        /// The setting's name, spelt as in the DeepSpeed config (`betas[0]`, `eps`, ...).
        name: &'static str,
        /// The offending value.
        value: f64,
        /// What the valid range is.
        reason: &'static str,
    },
    /// The parameter segments do not describe the shard.
    #[error("invalid segment #{index} (parameter {param_id}, range {start}..{end}): {reason}")]
    InvalidSegment {
        /// Position of the segment in the list.
        index: usize,
        /// The parameter the segment belongs to.
        param_id: usize,
        /// Start of the range in the shard.
        start: usize,
        /// End of the range in the shard.
        end: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// A checkpoint lacks a state buffer this optimizer keeps.
    #[error("optimizer state `{name}` is missing from the checkpoint (the optimizer keeps: {expected})")]
    MissingState {
        /// The missing buffer.
        name: String,
        /// The buffers this optimizer keeps, comma separated.
        expected: String,
    },
    /// A checkpoint carries a state buffer this optimizer does not know.
    #[error("optimizer state `{name}` is not kept by this optimizer (it keeps: {expected}); was the checkpoint written with another optimizer type?")]
    UnknownState {
        /// The unexpected buffer.
        name: String,
        /// The buffers this optimizer keeps, comma separated.
        expected: String,
    },
    /// The two-phase step was driven out of order.
    #[error("two-phase step out of order: {0}")]
    PhaseOrder(&'static str),
    /// The cross-rank norm totals do not cover every parameter.
    #[error("norm totals have {actual} entries, expected {expected} (two per parameter)")]
    NormTotalsLength {
        /// 2 × the number of parameters.
        expected: usize,
        /// The length passed.
        actual: usize,
    },
    /// The optimizer's thread pool could not be started.
    #[error("could not start the optimizer's CPU threads: {0}")]
    ThreadPool(String),
    /// A requested SIMD path is not available on this CPU.
    #[error("the {0} kernel is not supported by this CPU")]
    UnsupportedIsa(&'static str),
}
