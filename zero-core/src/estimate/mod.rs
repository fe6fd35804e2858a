//! Bytes of model states per device and per host for a ZeRO stage, by the ZeRO paper's
//! formulas, with optimizer and parameter offload.
//!
//! With Ψ parameters, N data-parallel devices, 16-bit parameters and gradients (2Ψ each) and
//! K = 12 bytes of fp32 optimizer state per parameter (master 4, Adam's two moments 4 + 4), a
//! device holds 16Ψ without ZeRO, 4Ψ + 12Ψ/N at stage 1, 2Ψ + 14Ψ/N at stage 2 and 16Ψ/N at
//! stage 3. In fp32 the parameters are their own masters: 4 + 4 + 8 bytes.
//!
//! Offloading the optimizer moves the K part (the rank's shard of masters and moments) to the
//! host or to NVMe, together with an fp32 copy of the rank's gradient shard that the host step
//! reads (stages 2-3: the device keeps no gradient shard; stages 0-1: the device keeps its full
//! gradients and the host the fp32 copy of its shard). In fp32 the offloaded part is 12Ψ/N too:
//! the step needs its masters beside the moments, and the parameters stay where they were.
//! Offloading parameters (stage 3) moves
//! the parameter shard too. What stage 3 holds gathered at once (the unit in use and the
//! prefetches in flight beside it: [`gathered_with_prefetch`]) stays on the device.
//!
//! Every count is checked: an input so large that a byte count would pass 2^64 (16 EiB, more
//! than any cluster holds) is an [`EstimateError`] naming the input, never a wrapped number.
//!
//! ```
//! use zero_core::estimate::{estimate, Dtype, EstimateInput};
//!
//! let e = estimate(&EstimateInput::new(1_000_000_000, 2, 8, Dtype::Bf16))?;
//! // Stage 2 on 8 devices: 2Ψ + 14Ψ/N.
//! assert_eq!(e.per_device.total(), 2_000_000_000 + 14_000_000_000 / 8);
//! # Ok::<(), zero_core::estimate::EstimateError>(())
//! ```

use serde::Serialize;

mod gpt2;
mod llama;

pub use gpt2::{Gpt2Shape, RankShape, GPT2_PRESETS};
pub use llama::{LlamaShape, LlamaShapeError, LLAMA_PRESETS};

/// Why an estimate cannot be given.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EstimateError {
    /// A count passes 2^64: the input is larger than any cluster.
    #[error(
        "{detail} does not fit a 64-bit count (more than 16 EiB); {input} = {value} is larger than any cluster holds"
    )]
    Overflow {
        /// The input to blame, by its field name in [`EstimateInput`] (`params`, `gpus_per_node`,
        /// `nodes`, `gathered_at_once`).
        input: &'static str,
        /// Its value.
        value: u64,
        /// What was being computed.
        detail: String,
    },
    /// The devices do not split into tensor-parallel groups of the size asked for.
    #[error("{world} devices do not split into tensor-parallel groups of {tensor}")]
    TensorParallel {
        /// Devices in all.
        world: u64,
        /// The tensor-parallel degree.
        tensor: u64,
    },
}

/// `a × b`, or an overflow error blaming `input`.
fn mul(a: u64, b: u64, input: &'static str, value: u64, detail: impl FnOnce() -> String) -> Result<u64, EstimateError> {
    a.checked_mul(b).ok_or_else(|| EstimateError::Overflow {
        input,
        value,
        detail: detail(),
    })
}

/// Why no GPT-2 depth can be given for memory limits ([`Gpt2Shape::deepest_fitting`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FitError {
    /// Not even one block fits.
    #[error("the smallest (1 layer) needs {} per host and {} per device", human_bytes(*.host_bytes), human_bytes(*.device_bytes))]
    NothingFits {
        /// Host bytes of the one-block model.
        host_bytes: u64,
        /// Device bytes of the one-block model.
        device_bytes: u64,
    },
    /// The limits do not bound the depth: nothing that grows with it is held where a limit
    /// applies (host memory at stage 3 without offload holds no model state).
    #[error(
        "the limits do not bound the depth: at this stage and offload no model state grows in host memory \
         with the depth, and the device memory has no limit"
    )]
    Unbounded,
    /// The hidden size gives no GPT-2 (not a multiple of 64, or zero).
    #[error("hidden size {0} gives no GPT-2 (it must be a positive multiple of 64)")]
    BadHidden(u64),
    /// The estimate of the one-block model overflows.
    #[error(transparent)]
    Estimate(#[from] EstimateError),
}

/// The dtype the model trains in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Dtype {
    /// bfloat16 parameters and gradients, fp32 masters.
    Bf16,
    /// IEEE half parameters and gradients, fp32 masters.
    Fp16,
    /// fp32 everywhere (the optimizer's masters a copy of the parameters).
    Fp32,
}

impl Dtype {
    /// Bytes per parameter element and per gradient element.
    pub fn param_bytes(self) -> u64 {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 2,
            Dtype::Fp32 => 4,
        }
    }

    /// K: optimizer-state bytes per parameter (Adam): the fp32 masters and two moments, 12 in
    /// every dtype. In fp32 too the optimizer keeps its masters apart from the model's
    /// parameters (it writes the model's from them after each step), where DeepSpeed's fp32
    /// layout updates the parameters themselves (8): the estimate is of this engine.
    pub fn optimizer_bytes(self) -> u64 {
        12
    }

    /// The dtype from its name (`bf16`, `fp16`, `fp32`).
    pub fn from_name(name: &str) -> Option<Dtype> {
        match name {
            "bf16" => Some(Dtype::Bf16),
            "fp16" => Some(Dtype::Fp16),
            "fp32" => Some(Dtype::Fp32),
            _ => None,
        }
    }
}

/// Where offloaded state goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum OffloadTarget {
    /// Host memory.
    Cpu,
    /// Files on an NVMe device.
    Nvme,
}

/// What to estimate.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EstimateInput {
    /// Ψ: trainable parameters.
    pub params: u64,
    /// The most parameters stage 3 holds gathered at once: the unit in use and the gathers in
    /// flight beside it (for a GPT-2: [`Gpt2Shape::gathered_at_once`]); `None` when unknown.
    pub gathered_at_once: Option<u64>,
    /// `stage3_prefetch_bucket_size`: elements gathered ahead of their use at stage 3 (0:
    /// none), which [`Gpt2Shape::input`] counts. Default [`DEFAULT_PREFETCH_BUCKET`].
    pub prefetch_bucket_size: u64,
    /// Parameters of the largest group stage 3 partitions as one flat buffer (a block's, or
    /// the embeddings'), which sizes the NVMe streaming buffers; `None` when unknown (then the
    /// whole model, an upper bound, as at stages 1-2).
    pub largest_group: Option<u64>,
    /// ZeRO stage, 0-3.
    pub stage: u8,
    /// Devices per node.
    pub gpus_per_node: u64,
    /// Nodes.
    pub nodes: u64,
    /// Optimizer offload.
    pub offload_optimizer: Option<OffloadTarget>,
    /// Parameter offload (stage 3 only).
    pub offload_param: Option<OffloadTarget>,
    /// Training dtype.
    pub dtype: Dtype,
    /// How NVMe-offloaded optimizer state streams through host memory.
    pub nvme_streaming: NvmeStreaming,
    /// Tensor-parallel degree T (1: none): `params` are then one tensor rank's, and ZeRO
    /// partitions over the N / T data-parallel devices.
    pub tensor_parallel: u64,
}

/// The host buffers an NVMe-offloaded optimizer step streams its state through: up to
/// `buffer_count` buffers of one chunk of every state buffer (masters and moments), and the
/// optimizer's scratch state for one chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct NvmeStreaming {
    /// `offload_optimizer.buffer_count` (DeepSpeed's default 4).
    pub buffer_count: u64,
    /// Elements of one chunk: `zero_optimization.sub_group_size` (default 1e9), within
    /// [`crate::offload::chunk_elements`]'s bounds.
    pub chunk_elements: u64,
}

impl Default for NvmeStreaming {
    fn default() -> Self {
        NvmeStreaming {
            buffer_count: 4,
            chunk_elements: crate::offload::MAX_CHUNK_ELEMENTS as u64,
        }
    }
}

impl NvmeStreaming {
    /// The buffers a group of `group` elements fills (no more than its chunks) and the
    /// elements of one chunk.
    pub fn buffers_and_chunk(&self, group: u64) -> (u64, u64) {
        let chunk = self.chunk_elements.max(1).min(group.max(1));
        (self.buffer_count.max(1).min(group.max(1).div_ceil(chunk)), chunk)
    }

    /// Host bytes per rank for a largest owned group of `group` elements and `width` fp32
    /// buffers per element (masters and moments): the buffers plus the scratch state of one
    /// chunk, as the engine allocates them.
    pub fn host_bytes(&self, group: u64, width: u64) -> Option<u64> {
        let (buffers, chunk) = self.buffers_and_chunk(group);
        buffers
            .checked_mul(width)?
            .checked_add(width.saturating_sub(1))?
            .checked_mul(chunk)?
            .checked_mul(4)
    }
}

impl EstimateInput {
    /// `params` parameters at `stage` on `devices` devices of one node, no offload.
    pub fn new(params: u64, stage: u8, devices: u64, dtype: Dtype) -> Self {
        EstimateInput {
            params,
            gathered_at_once: None,
            prefetch_bucket_size: DEFAULT_PREFETCH_BUCKET,
            largest_group: None,
            stage,
            gpus_per_node: devices,
            nodes: 1,
            offload_optimizer: None,
            offload_param: None,
            dtype,
            nvme_streaming: NvmeStreaming::default(),
            tensor_parallel: 1,
        }
    }

    /// Devices in all.
    pub fn world(&self) -> Result<u64, EstimateError> {
        let world = mul(self.gpus_per_node, self.nodes, "nodes", self.nodes, || {
            format!("{} devices per node × {} nodes", self.gpus_per_node, self.nodes)
        })?;
        Ok(world.max(1))
    }

    /// N: the data-parallel devices ZeRO partitions over (all of them, divided by the
    /// tensor-parallel degree).
    pub fn data_parallel(&self) -> Result<u64, EstimateError> {
        let (world, tensor) = (self.world()?, self.tensor_parallel.max(1));
        if !world.is_multiple_of(tensor) {
            return Err(EstimateError::TensorParallel { world, tensor });
        }
        Ok(world / tensor)
    }
}

/// Bytes of each kind of model state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StateBytes {
    /// Parameters (16-bit, or fp32 under fp32).
    pub parameters: u64,
    /// Gradients (the device's, or the host's fp32 copy of the shard).
    pub gradients: u64,
    /// Optimizer state: fp32 masters (mixed precision) and moments.
    pub optimizer_state: u64,
    /// Stage 3's gathered parameters: the unit in use and the prefetches in flight beside it.
    pub gathered: u64,
}

impl StateBytes {
    /// Sum of every kind. An [`Estimate`]'s sums always fit ([`estimate`] checks them); one
    /// built by hand that does not saturates at `u64::MAX`.
    pub fn total(&self) -> u64 {
        self.checked_total().unwrap_or(u64::MAX)
    }

    fn checked_total(&self) -> Option<u64> {
        self.parameters
            .checked_add(self.gradients)?
            .checked_add(self.optimizer_state)?
            .checked_add(self.gathered)
    }

    /// Every kind times `g` (the devices of a node), with the sum checked. An overflow blames
    /// the larger of the two inputs it comes from: `g` or `params`.
    fn scaled(self, g: u64, params: u64, where_: &str) -> Result<StateBytes, EstimateError> {
        let overflow = || {
            let (input, value) = if g >= params {
                ("gpus_per_node", g)
            } else {
                ("params", params)
            };
            EstimateError::Overflow {
                input,
                value,
                detail: format!(
                    "{where_}: {g} device(s) × {} bytes of model states each ({params} parameters)",
                    self.total()
                ),
            }
        };
        let one = |v: u64| v.checked_mul(g).ok_or_else(overflow);
        let scaled = StateBytes {
            parameters: one(self.parameters)?,
            gradients: one(self.gradients)?,
            optimizer_state: one(self.optimizer_state)?,
            gathered: one(self.gathered)?,
        };
        scaled.checked_total().ok_or_else(overflow)?;
        Ok(scaled)
    }
}

/// The estimate: bytes per device, per host (every device of a node), per node on NVMe.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Estimate {
    /// What one device holds.
    pub per_device: StateBytes,
    /// What one node's host memory holds for all its devices.
    pub per_host: StateBytes,
    /// What one node's NVMe holds for all its devices.
    pub per_node_nvme: StateBytes,
    /// The formulas used, in Ψ and N, one line per location.
    pub formula: Vec<String>,
}

/// Integer `bytes_per_param × params / n`, rounded up (a shard is never smaller).
fn share(bytes_per_param: u64, params: u64, n: u64) -> Result<u64, EstimateError> {
    let bytes = mul(bytes_per_param, params, "params", params, || {
        format!("{bytes_per_param} bytes per parameter × {params} parameters")
    })?;
    Ok(bytes.div_ceil(n))
}

/// Computes the estimate for `input` (see the module documentation for the formulas).
pub fn estimate(input: &EstimateInput) -> Result<Estimate, EstimateError> {
    let psi = input.params;
    let n = input.data_parallel()?;
    let p = input.dtype.param_bytes();
    let k = input.dtype.optimizer_bytes();
    let stage = input.stage.min(3);
    let n_opt = if stage >= 1 { n } else { 1 };
    let n_grad = if stage >= 2 { n } else { 1 };
    let n_param = if stage >= 3 { n } else { 1 };
    let frac = |x: u64| {
        if x == 1 {
            String::new()
        } else {
            "/N".to_string()
        }
    };

    let gathered = match (stage, input.gathered_at_once) {
        (3, Some(b)) => mul(p, b, "gathered_at_once", b, || {
            format!("{p} bytes per parameter × {b} gathered parameters")
        })?,
        _ => 0,
    };
    let mut device = StateBytes {
        parameters: share(p, psi, n_param)?,
        gradients: share(p, psi, n_grad)?,
        optimizer_state: share(k, psi, n_opt)?,
        gathered,
    };
    let mut device_terms = vec![
        format!("params {p}Ψ{}", frac(n_param)),
        format!("grads {p}Ψ{}", frac(n_grad)),
        format!("optimizer {k}Ψ{}", frac(n_opt)),
    ];
    if device.gathered > 0 {
        device_terms.push(format!("gathered {p}·B (B = {})", input.gathered_at_once.unwrap_or(0)));
    }
    let mut host = StateBytes::default();
    let mut nvme = StateBytes::default();
    let mut host_terms = Vec::new();
    let mut nvme_terms = Vec::new();

    if let Some(target) = input.offload_optimizer {
        let (place, terms) = match target {
            OffloadTarget::Cpu => (&mut host, &mut host_terms),
            OffloadTarget::Nvme => (&mut nvme, &mut nvme_terms),
        };
        // The fp32 masters travel with the offloaded moments.
        place.optimizer_state = share(k, psi, n_opt)?;
        terms.push(format!("optimizer {k}Ψ{}", frac(n_opt)));
        device.optimizer_state = 0;
        device_terms.retain(|t| !t.starts_with("optimizer"));
        if target == OffloadTarget::Nvme {
            // On NVMe, the state passes through host buffers of a chunk of every state buffer,
            // sized by the largest group a rank owns: at stage 3 a block's or the embeddings'
            // shard, otherwise, at most, the rank's whole shard.
            let width = k / 4;
            let unit = input.largest_group.filter(|_| stage == 3).unwrap_or(psi).min(psi);
            let group = unit.div_ceil(n_opt);
            host.optimizer_state =
                input
                    .nvme_streaming
                    .host_bytes(group, width)
                    .ok_or_else(|| EstimateError::Overflow {
                        input: "params",
                        value: psi,
                        detail: format!("the NVMe streaming buffers for groups of {group} elements"),
                    })?;
            let (buffers, chunk) = input.nvme_streaming.buffers_and_chunk(group);
            host_terms.push(format!(
                "NVMe streaming buffers (b·{width} + {}) × 4·C (b = {buffers}, C = {chunk})",
                width - 1
            ));
        }
        // The host step reads an fp32 gradient shard; it lives in host memory even when the
        // optimizer state is on NVMe (it is consumed as it streams). The model's gradients stay
        // on the device until the step (Burn's backward leaves them there, reduce-scattered at
        // stages 2-3), which brings the rank's shard down.
        host.gradients = share(4, psi, n_opt)?;
        host_terms.push(format!("fp32 grad shard 4Ψ{}", frac(n_opt)));
    }
    if let (Some(target), 3) = (input.offload_param, stage) {
        let (place, terms) = match target {
            OffloadTarget::Cpu => (&mut host, &mut host_terms),
            OffloadTarget::Nvme => (&mut nvme, &mut nvme_terms),
        };
        place.parameters = device.parameters;
        terms.push(format!("params {p}Ψ/N"));
        device.parameters = 0;
        device_terms.retain(|t| !t.starts_with("params"));
    }

    let g = input.gpus_per_node.max(1);
    let mut formula = vec![format!("per device: {}", join_terms(&device_terms))];
    if !host_terms.is_empty() {
        formula.push(format!("per host: G × ({})", host_terms.join(" + ")));
    }
    if !nvme_terms.is_empty() {
        formula.push(format!("per node on NVMe: G × ({})", nvme_terms.join(" + ")));
    }
    Ok(Estimate {
        per_device: device.scaled(1, psi, "per device")?,
        per_host: host.scaled(g, psi, "per host")?,
        per_node_nvme: nvme.scaled(g, psi, "per node on NVMe")?,
        formula,
    })
}

fn join_terms(terms: &[String]) -> String {
    if terms.is_empty() {
        "nothing".into()
    } else {
        terms.join(" + ")
    }
}

/// DeepSpeed's default `stage3_prefetch_bucket_size` (elements), the config parser's too.
pub const DEFAULT_PREFETCH_BUCKET: u64 = 50_000_000;

/// The most held gathered at once at stage 3 with prefetching, for units of `units` (elements
/// or bytes, the same for `budget`) gathered whole one at a time, and a prefetch budget of
/// `budget`: the unit in use and the gathers in flight beside it, which are started while less
/// than `budget` is in flight, so at most the budget and one other unit (one unit alone when
/// every other unit is at least the budget: the first started fills it), never more than all
/// the others. A budget of 0 (no prefetch): the largest unit. The rule of `ZeroOptimizer`'s
/// memory report, which the prefetch schedule's tests check against the gathers it starts.
pub fn gathered_with_prefetch(units: &[u64], budget: u64) -> u64 {
    let counted: Vec<(u64, u64)> = units.iter().map(|&u| (u, 1)).collect();
    gathered_with_prefetch_counted(&counted, budget)
}

/// [`gathered_with_prefetch`] for `count` units of each `size` (a model of many equal blocks).
fn gathered_with_prefetch_counted(units: &[(u64, u64)], budget: u64) -> u64 {
    let units: Vec<(u64, u64)> = units.iter().copied().filter(|&(_, count)| count > 0).collect();
    if budget == 0 {
        return units.iter().map(|&(size, _)| size).max().unwrap_or(0);
    }
    let all = units
        .iter()
        .fold(0u64, |a, &(size, count)| a.saturating_add(size.saturating_mul(count)));
    (0..units.len())
        .map(|i| {
            let (size, count) = units[i];
            // The others: every other kind, and this kind's other units.
            let others = units
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != i || count > 1)
                .map(|(_, &(other, _))| other);
            let (largest, smallest) = others.fold((0, u64::MAX), |(l, s), v| (l.max(v), s.min(v)));
            let before_last = if smallest >= budget { 0 } else { budget };
            size.saturating_add(before_last.saturating_add(largest).min(all - size))
        })
        .max()
        .unwrap_or(0)
}

/// `bytes` in the largest binary unit that keeps it at least 1 (e.g. `1.50 GiB`).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests;
