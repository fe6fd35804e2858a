//! The per-unit hook of ZeRO stage 3 inside Burn's own autodiff graph: `gather_parts(shard)` is
//! a differentiable op whose forward all-gathers the rank's flat shard into the unit's whole flat
//! parameters, and whose backward reduce-scatters the whole gradient into the shard's gradient
//! (the mean over the ranks: data-parallel averaging). No nested `backward()` runs, so nothing
//! waits on burn-autodiff 0.21's graph locks.
//!
//! The whole vector is handed out as the unit's parameters, one op per part. Burn's own slice
//! would give each part a gradient of the whole vector's size (zeros with the part written in,
//! then summed: a unit of k parameters moves k whole vectors in backward); a part here leaves
//! its gradient with the gather, which puts the parts together once. A unit held whole (stages
//! 0-2) goes through the same ops without the collectives.
//!
//! The op is memory-bound with a retro-forward that gathers again: under
//! `Autodiff<B, BalancedCheckpointing>` the ops that consume the gathered weights keep a recipe
//! instead of the weights, so the whole parameters are freed after forward and gathered again
//! when backward needs them (stage 3). Under `Autodiff<B>` (no checkpointing) the weights stay
//! alive until backward: the same gradients, stage 2's memory.
//!
//! `after`, a tensor the unit's computation starts from (its input), is a parent of the op
//! without a gradient: it raises the op's depth in the tape, which burn 0.21 runs deepest first,
//! so the reduce-scatter runs right after the unit's own backward instead of at the very end
//! with every unit's whole gradient alive.

use super::ledger::{self, Ticket};
use super::offload::ParamStore;
use super::prefetch::{Phase, Prefetcher};
use crate::device::DeviceCollective;
use crate::error::ZeroError;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorMetadata, TensorPrimitive};
use std::sync::{Arc, Mutex};
use zero_core::comm::{ReduceOp, Subject};

/// The ranks a unit is sharded over.
pub type UnitComm<I> = Arc<dyn DeviceCollective<I>>;

/// How a sharded unit's whole vector is gathered: over its ranks, through the schedule that
/// prefetches its gathers where there is one (with the unit's number in it).
#[derive(Clone, Debug)]
pub struct UnitGather<I: Backend> {
    pub(crate) comm: UnitComm<I>,
    pub(crate) prefetch: Option<(Arc<Prefetcher<I>>, u64)>,
    /// The dtype the gradient is reduced in (`communication_data_type`), when not its own.
    pub(crate) grad_dtype: Option<burn::tensor::DType>,
    /// Where the shard's values are when the parameter holds a placeholder (`offload_param`):
    /// read for every gather, forward and backward.
    pub(crate) source: Option<Arc<ParamStore>>,
    /// The unit, as its collectives name it to the peers.
    pub(crate) subject: Subject,
}

impl<I: Backend> UnitGather<I> {
    /// The whole vector of the unit whose shard on this rank is `shard` (the value `key` names),
    /// needed in `phase`.
    pub(crate) fn all_gather(&self, shard: Tensor<I, 1>, key: u64, phase: Phase) -> Result<Tensor<I, 1>, ZeroError> {
        match (&self.prefetch, &self.source) {
            (Some((prefetch, unit)), None) => prefetch.fetch(*unit, self.subject, key, shard, phase),
            _ => self.gather_now(shard),
        }
        .map_err(|e| explain(e, phase))
    }

    /// The whole vector gathered now, outside the prefetch schedule.
    pub(crate) fn gather_now(&self, shard: Tensor<I, 1>) -> Result<Tensor<I, 1>, ZeroError> {
        match &self.source {
            Some(store) => self
                .comm
                .all_gather_of(store.read_tensor::<I>(&shard.device())?, self.subject),
            None => self.comm.all_gather_of(shard, self.subject),
        }
    }

    /// The mean over the ranks of the unit's whole gradient, cut to this rank's shard.
    fn reduce_scatter(&self, whole: Tensor<I, 1>) -> Result<Tensor<I, 1>, ZeroError> {
        if let Some((prefetch, _)) = &self.prefetch {
            prefetch.backward_began();
        }
        match self.grad_dtype.filter(|&d| d != whole.dtype()) {
            Some(comm) => {
                let own = whole.dtype();
                let shard =
                    self.comm
                        .reduce_scatter_of(crate::device::cast(whole, comm), ReduceOp::Avg, self.subject)?;
                Ok(crate::device::cast(shard, own))
            }
            None => self.comm.reduce_scatter_of(whole, ReduceOp::Avg, self.subject),
        }
    }
}

/// `e`, a failed gather of `phase`, with what the user can do about ranks that paired
/// different units there.
fn explain(e: ZeroError, phase: Phase) -> ZeroError {
    // A poisoned group repeats an earlier cause (another op's): only a gather's is explained.
    let ZeroError::Comm(mismatch @ zero_core::comm::CommError::SubjectMismatch { op, .. }) = &e else {
        return e;
    };
    if op != "all_gather" {
        return e;
    }
    ZeroError::Usage(match phase {
        Phase::Forward => format!(
            "ZeRO: {mismatch}: the ranks called the model's units in a different order. Every rank must call \
             each ZeroModule (unshard or gathered) in the same order every micro-batch, also one that gets no \
             rows on this rank (call it with the empty input)"
        ),
        Phase::Backward => format!(
            "ZeRO stage 3: {mismatch}, gathering units again in backward: under a checkpointing strategy \
             (BalancedCheckpointing) a unit's parameters are gathered again only on the ranks whose loss the unit \
             reached, and here a unit reached one rank's loss and not another's (an expert given no rows whose \
             output is left out). Keep every unit's output in every rank's loss (an expert with no rows adds \
             its empty sum), or train without a checkpointing strategy (Autodiff<B>)"
        ),
    })
}

/// What identifies the value of an autodiff tensor: its node, new for every tensor an op or a
/// write makes (a clone shares it).
pub(crate) fn value_key<I: Backend, C: CheckpointStrategy>(t: &Tensor<Autodiff<I, C>, 1>) -> u64 {
    t.clone().into_primitive().tensor().node.id.value
}

fn tensor<I: Backend>(primitive: FloatTensor<I>) -> Tensor<I, 1> {
    Tensor::from_primitive(TensorPrimitive::Float(primitive))
}

/// The gradients of one gather's parts, by part, left by each part's backward for the gather's
/// backward to put together (a part no loss reached stays `None`: zeros).
type PartGrads<I> = Arc<Mutex<Vec<Option<FloatTensor<I>>>>>;

/// What the gather's backward keeps: the group (none for a unit held whole), the parts' lengths
/// and where their gradients arrive, the entry in the rank's ledger and where the chain token
/// it took sits among its parents. No tensor.
#[derive(Clone, Debug)]
struct GatherState<I: Backend> {
    gather: Option<UnitGather<I>>,
    sizes: Vec<usize>,
    /// Elements of the gathered vector (the parts and the padding).
    len: usize,
    grads: PartGrads<I>,
    /// Where and in what dtype the gradient is made when no part got one.
    device: I::Device,
    dtype: burn::tensor::DType,
    ticket: Option<Ticket>,
    /// The index among the op's parents of the previous gather's chain token.
    chain: Option<usize>,
    /// `after`'s shape and dtype, when it is a parent (index 1).
    after: Option<(burn::tensor::Shape, burn::tensor::DType)>,
}

/// The backward step, with 1 to 3 parents: the shard, then `after` and the chain token where
/// there are.
#[derive(Debug)]
struct GatherBackward;

impl<I: Backend, const N: usize> Backward<I, N> for GatherBackward {
    type State = GatherState<I>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        // The parts, and the next gather's chain token, registered a one-element token here;
        // the parts' gradients are in the state.
        let _ = grads.consume::<I>(&ops.node);
        let state = ops.state;
        // The earlier gathers' steps consume the chain token's gradient: always registered.
        if let Some(chain) = state.chain.and_then(|i| ops.parents[i].as_ref()) {
            grads.register::<I>(chain.id, I::float_zeros([1].into(), &state.device, state.dtype.into()));
        }
        // The units after this one that this rank's loss did not reach: their zero
        // reduce-scatters first, in the order every rank follows.
        if let Some(ticket) = state.ticket {
            ledger::reached(ticket, grads);
        }
        // A unit reached only through the chain (its output did not reach this rank's loss):
        // what its input comes from is in this backward too, and gets a zero gradient through
        // it, as the one process's backward gives the rows this rank did not route there.
        let reached = state
            .grads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(Option::is_some);
        if let (false, Some((shape, dtype)), Some(after)) =
            (reached, &state.after, ops.parents.get(1).and_then(Option::as_ref))
        {
            grads.register::<I>(after.id, I::float_zeros(shape.clone(), &state.device, (*dtype).into()));
        }
        let Some(node) = &ops.parents[0] else { return };
        let whole = gathered_gradient::<I>(&state);
        let shard = match &state.gather {
            // A backward step cannot return an error: a failed collective (a dead peer, a
            // timeout, two ranks pairing different units, all named by the group) is kept
            // for the next forward or step to return, and the backward goes on with zeros.
            Some(gather) => match gather.reduce_scatter(whole) {
                Ok(shard) => shard,
                Err(e) => {
                    ledger::fail(e);
                    let n = state.len / gather.comm.world_size().max(1);
                    Tensor::<I, 1>::zeros([n], (&state.device, state.dtype))
                }
            },
            None => whole,
        };
        // The other parents (`after`, the chain token) get no gradient from this op.
        grads.register::<I>(node.id, shard.into_primitive().tensor());
    }
}

/// The unit's whole gradient from its parts' (zeros for a part no loss reached, and for the
/// padding).
fn gathered_gradient<I: Backend>(state: &GatherState<I>) -> Tensor<I, 1> {
    let mut parts = state.grads.lock().unwrap_or_else(|e| e.into_inner());
    let dtype = parts.iter().flatten().next().map(|g| g.dtype()).unwrap_or(state.dtype);
    let zeros = |n: usize| I::float_zeros([n].into(), &state.device, dtype.into());
    // A part of no elements is left out: on CUDA its fill or its copy into the whole would
    // be a kernel over no blocks, which the driver refuses.
    let mut pieces: Vec<FloatTensor<I>> = parts
        .iter_mut()
        .zip(&state.sizes)
        .filter(|(_, &n)| n > 0)
        .map(|(g, &n)| g.take().unwrap_or_else(|| zeros(n)))
        .collect();
    drop(parts);
    let used: usize = state.sizes.iter().sum();
    if state.len > used {
        pieces.push(zeros(state.len - used));
    }
    match pieces.len() {
        0 => Tensor::<I, 1>::zeros([0], (&state.device, dtype)),
        _ => tensor::<I>(I::float_cat(pieces, 0)),
    }
}

/// The zero gradient's reduce-scatter of a unit this rank's loss did not reach, its result
/// (the other ranks' average) registered as the shard's gradient.
fn release<I: Backend>(
    gather: UnitGather<I>,
    shard: NodeId,
    len: usize,
    device: I::Device,
    dtype: burn::tensor::DType,
) -> ledger::Release {
    Box::new(move |grads: &mut Gradients| {
        let zeros = Tensor::<I, 1>::zeros([len], (&device, dtype));
        let reduced = gather.reduce_scatter(zeros)?;
        grads.register::<I>(shard, reduced.into_primitive().tensor());
        Ok(())
    })
}

/// The chain token's backward: hands the next gather's one-element gradient to the gather that
/// made the token, so that its step finds its node's gradient.
#[derive(Debug)]
struct ChainBackward;

impl<I: Backend> Backward<I, 1> for ChainBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<I>(&ops.node);
        if let Some(parent) = &ops.parents[0] {
            grads.register::<I>(parent.id, grad);
        }
    }
}

/// The recipe kept instead of the gathered parameters (checkpointing strategies that recompute
/// memory-bound ops): gather again.
#[derive(Debug)]
struct RetroGather<I: Backend> {
    shard: NodeId,
    /// The other parents (`after`, the chain token), whose states the checkpointer counted.
    others: Vec<NodeId>,
    gather: Option<UnitGather<I>>,
    /// The unit's whole vector kept between steps (stage 2): handed out again, not gathered.
    kept: Option<FloatTensor<I>>,
}

impl<I: Backend> RetroForward for RetroGather<I> {
    fn forward(&self, states: &mut BackwardStates, out: NodeId) {
        let shard: FloatTensor<I> = states.get_state(&self.shard);
        // The checkpointer counted a use of each parent for this op. Take them, or their
        // states stay alive to the end of backward.
        for other in &self.others {
            let _ = states.get_state::<FloatTensor<I>>(other);
        }
        let whole = match (&self.kept, &self.gather) {
            (Some(kept), _) => kept.clone(),
            (None, Some(gather)) => {
                let n = shard.shape().num_elements() * gather.comm.world_size();
                let (device, dtype) = (I::float_device(&shard), shard.dtype());
                match gather.all_gather(tensor::<I>(shard), self.shard.value, Phase::Backward) {
                    Ok(whole) => whole.into_primitive().tensor(),
                    // Kept for the next forward or step to return (see GatherBackward).
                    Err(e) => {
                        ledger::fail(e);
                        I::float_zeros([n].into(), &device, dtype.into())
                    }
                }
            }
            (None, None) => shard,
        };
        states.save(out, whole);
    }
}

/// One part of a gathered vector: its backward leaves the part's gradient for the gather's
/// backward instead of a zero-filled gradient of the whole vector per part.
#[derive(Debug)]
struct PartBackward;

#[derive(Clone, Debug)]
struct PartState<I: Backend> {
    index: usize,
    grads: PartGrads<I>,
}

impl<I: Backend> Backward<I, 1> for PartBackward {
    type State = PartState<I>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<I>(&ops.node);
        let device = I::float_device(&grad);
        let dtype = grad.dtype();
        let mut parts = ops.state.grads.lock().unwrap_or_else(|e| e.into_inner());
        let slot = &mut parts[ops.state.index];
        *slot = Some(match slot.take() {
            Some(old) => I::float_add(old, grad),
            None => grad,
        });
        drop(parts);
        // A one-element token, so that the gather's backward finds its node's gradient.
        if let Some(node) = &ops.parents[0] {
            grads.register::<I>(node.id, I::float_zeros([1].into(), &device, dtype.into()));
        }
    }
}

/// `len` elements of `whole` from `start`.
fn cut<I: Backend>(whole: FloatTensor<I>, start: usize, len: usize) -> FloatTensor<I> {
    tensor::<I>(whole).narrow(0, start, len).into_primitive().tensor()
}

/// The recipe of a part: cut it from the gathered vector again.
#[derive(Debug)]
struct RetroPart<I> {
    whole: NodeId,
    start: usize,
    len: usize,
    _backend: std::marker::PhantomData<I>,
}

impl<I: Backend> RetroForward for RetroPart<I> {
    fn forward(&self, states: &mut BackwardStates, out: NodeId) {
        let whole: FloatTensor<I> = states.get_state(&self.whole);
        states.save(out, cut::<I>(whole, self.start, self.len));
    }
}

/// The gather op over `parents` (the shard first), tracked or not.
fn finish_gather<I: Backend, C: CheckpointStrategy, const N: usize>(
    parents: &[FloatTensor<Autodiff<I, C>>],
    retro: RetroGather<I>,
    state: GatherState<I>,
    whole: FloatTensor<I>,
) -> FloatTensor<Autodiff<I, C>> {
    let nodes: [_; N] = std::array::from_fn(|i| parents[i].node.clone());
    let prep = <GatherBackward as Backward<I, N>>::prepare::<C>(GatherBackward, nodes);
    match prep
        .memory_bound()
        .retro_forward(retro)
        .parents(parents.iter().take(N))
        .stateful()
    {
        OpsKind::Tracked(p) => p.finish(state, whole),
        OpsKind::UnTracked(p) => p.finish(whole),
    }
}

/// The unit's parameters from this rank's `shard` as flat parts of lengths `sizes` (in order),
/// as differentiable ops: with `gather`, every rank's shard is gathered (the unit's whole flat
/// parameters, padding after the parts) and the gradient reaching the parts is put together,
/// averaged over the ranks and cut to this rank's shard; without, `shard` is the whole vector
/// and its gradient is the parts' put together. `kept`, the unit's whole vector as gathered
/// after the last step (stage 2), stands in for the all-gather, in forward and when backward
/// needs the parameters again; the gradient is reduce-scattered all the same. `after`
/// (optional) orders that backward right after the backward of what it feeds (see the module
/// docs).
pub(crate) fn gather_parts<I, C, const D: usize>(
    shard: Tensor<Autodiff<I, C>, 1>,
    after: Option<&Tensor<Autodiff<I, C>, D>>,
    gather: Option<&UnitGather<I>>,
    kept: Option<Tensor<I, 1>>,
    sizes: &[usize],
) -> Result<Vec<Tensor<Autodiff<I, C>, 1>>, ZeroError>
where
    I: Backend,
    C: CheckpointStrategy,
{
    let shard = shard.into_primitive().tensor();
    // Only a tracked parent helps: an untracked one would make the op compute-bound (the
    // gathered weights kept).
    let after = after
        .map(|t| t.clone().into_primitive().tensor())
        .filter(|t| !t.node.requirement.is_none());
    let kept = kept.map(|k| k.into_primitive().tensor());
    let whole = match (&kept, gather) {
        (Some(kept), _) => kept.clone(),
        (None, Some(gather)) => gather
            .all_gather(
                tensor::<I>(shard.primitive.clone()),
                shard.node.id.value,
                Phase::Forward,
            )?
            .into_primitive()
            .tensor(),
        (None, None) => shard.primitive.clone(),
    };
    let len = whole.shape().num_elements();
    let (device, dtype) = (I::float_device(&whole), whole.dtype());
    // A tracked gather of a unit cut over the ranks is an entry of this rank's ledger, chained
    // to the previous one (see `ledger`).
    let tracked = !shard.node.requirement.is_none() || after.is_some();
    let (ticket, chain) = match gather.filter(|g| tracked && g.comm.world_size() > 1) {
        Some(g) => {
            let release = release::<I>(g.clone(), shard.node.id, len, device.clone(), dtype);
            let (ticket, chain) = ledger::enter(release)?;
            let chain = chain
                .and_then(|c| c.downcast::<FloatTensor<Autodiff<I, C>>>().ok())
                .map(|c| *c)
                .filter(|c| !c.node.requirement.is_none());
            (Some(ticket), chain)
        }
        None => (None, None),
    };
    let part_grads: PartGrads<I> = Arc::new(Mutex::new(vec![None; sizes.len()]));
    let mut parents = vec![shard.clone()];
    parents.extend(after.iter().cloned());
    let chain_index = chain.as_ref().map(|_| parents.len());
    parents.extend(chain);
    let state = GatherState {
        gather: gather.cloned(),
        sizes: sizes.to_vec(),
        len,
        grads: part_grads.clone(),
        device: device.clone(),
        dtype,
        ticket,
        chain: chain_index,
        after: after.as_ref().map(|t| (t.shape(), t.dtype())),
    };
    let retro = RetroGather::<I> {
        shard: shard.node.id,
        others: parents[1..].iter().map(|t| t.node.id).collect(),
        gather: gather.cloned(),
        kept,
    };
    let whole = match parents.len() {
        1 => finish_gather::<I, C, 1>(&parents, retro, state, whole),
        2 => finish_gather::<I, C, 2>(&parents, retro, state, whole),
        _ => finish_gather::<I, C, 3>(&parents, retro, state, whole),
    };
    if ticket.is_some() {
        let token = I::float_zeros([1].into(), &device, dtype.into());
        let token = match <ChainBackward as Backward<I, 1>>::prepare::<C>(ChainBackward, [whole.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(p) => p.finish((), token),
            OpsKind::UnTracked(p) => p.finish(token),
        };
        ledger::set_chain(Box::new(token));
    }
    let mut start = 0;
    let parts = sizes
        .iter()
        .enumerate()
        .map(|(index, &n)| {
            let value = cut::<I>(whole.primitive.clone(), start, n);
            let retro = RetroPart::<I> {
                whole: whole.node.id,
                start,
                len: n,
                _backend: std::marker::PhantomData,
            };
            start += n;
            let state = PartState {
                index,
                grads: part_grads.clone(),
            };
            let part = match PartBackward
                .prepare::<C>([whole.node.clone()])
                .memory_bound()
                .retro_forward(retro)
                .parents([&whole])
                .stateful()
            {
                OpsKind::Tracked(p) => p.finish(state, value),
                OpsKind::UnTracked(p) => p.finish(value),
            };
            Tensor::from_primitive(TensorPrimitive::Float(part))
        })
        .collect();
    Ok(parts)
}
