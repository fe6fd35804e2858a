//! A dedicated set of CPU threads for optimizer steps.

use super::OptimError;

/// A pool of `threads` CPU threads that optimizer steps run on (ZeRO-Offload's optimizer
/// threads), instead of the process-wide pool that the tensor backend also uses. Every kernel of
/// this module splits its work over the pool it is called from.
#[derive(Debug)]
pub struct CpuPool {
    pool: rayon::ThreadPool,
}

impl CpuPool {
    /// A pool of `threads` threads (at least 1).
    pub fn new(threads: usize) -> Result<Self, OptimError> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("zero-optim-{i}"))
            .build()
            .map_err(|e| OptimError::ThreadPool(e.to_string()))?;
        Ok(CpuPool { pool })
    }

    /// Number of threads.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Runs `f` (for example a [`ShardOptimizer::step`](super::ShardOptimizer::step)) on this pool.
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }
}
