//! `ZeroModule`: a Burn module whose float parameters live as one flat vector, cut into one shard
//! per rank at stage 3 ([`shard_units`](super::shard_units)), itself a Burn `Module` that can be a field of any model. Its whole
//! module is reached for one forward through [`ZeroModule::unshard`]; under autodiff the gather
//! is the differentiable op of [`gather`](super::gather), so `loss.backward()` leaves the
//! shard's gradient (averaged over the ranks) where Burn's optimizers and `GradientsParams` look
//! for it.

use super::backend::{ShardBackend, ShardComm};
use super::gather::UnitGather;
use super::offload::{placeholder, ParamStore};
use super::prefetch::{Phase, Prefetcher};
use super::skeleton::{Emptied, Filled};
use super::unit_param::UnitParam;
use crate::error::ZeroError;
use crate::params::read_values;
use burn::module::{Module, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{Shape, Tensor, TensorData};
use std::any::Any;
use std::collections::VecDeque;
use std::sync::Arc;

/// Elements a unit's flat vector is padded to a multiple of, per rank: its shards are cut as the
/// optimizer's layout cuts a sharded group of that alignment, so that a rank's shard is the slice
/// the optimizer owns.
pub const UNIT_ALIGNMENT: usize = 16;

/// This rank's shard length for a unit of `numel` elements over `world` ranks.
pub fn shard_len(numel: usize, world: usize) -> usize {
    numel.div_ceil(world * UNIT_ALIGNMENT).max(1) * UNIT_ALIGNMENT
}

/// Where each float parameter of a unit sits in its flat vector.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnitLayout {
    /// Shapes of the float parameters, in visit order.
    pub shapes: Vec<Vec<usize>>,
    /// Elements of each rank's shard once sharded (the flat vector zero-padded to a multiple of
    /// the ranks); the whole flat vector's length before.
    pub shard_len: usize,
}

impl UnitLayout {
    /// Elements of the parameters (padding excluded).
    pub fn numel(&self) -> usize {
        self.shapes.iter().map(|s| s.iter().product::<usize>()).sum()
    }
}

/// The ranks a unit is sharded over, once it is.
#[derive(Debug)]
pub(super) struct Sharding {
    pub(super) comm: ShardComm,
    pub(super) world: usize,
    /// The whole vector is gathered once per value of the shard (after each step) and kept
    /// until the next (stage 2), rather than gathered for every use (stage 3).
    pub(super) keep: bool,
    /// The schedule that gathers this unit ahead of its use (a `Prefetcher` of the
    /// collective's backend), when the cut asked for one.
    pub(super) prefetch: std::sync::OnceLock<Arc<dyn Any + Send + Sync>>,
    /// What a new shard value written by a step does to the unit ([`after_step`](super::cut::after_step)).
    pub(super) after_step: std::sync::OnceLock<AfterStep>,
    /// The dtype the unit's gradient is reduce-scattered in, when not its own
    /// ([`UnitPlan::grad_dtype`](super::UnitPlan::grad_dtype)).
    pub(super) grad_dtype: Option<burn::tensor::DType>,
    /// Where the shard is kept off the device (`offload_param`), when it is.
    pub(super) store: std::sync::OnceLock<Arc<ParamStore>>,
}

/// Takes a unit's new shard (a `Tensor<B, 1>` of the backend the unit was cut for, hence `Any`)
/// and its parameter's id, and returns the parameter (`Param<Tensor<B, 1>>`) to hold instead,
/// if any: at stage 2 the shard as a view of its whole vector, gathered at once; with
/// `offload_param` a placeholder, the shard moved into its store; otherwise the prefetch
/// schedule is told the value.
pub(super) struct AfterStep(pub(super) Box<ReplaceShard>);

/// A function of a unit's shard (as `Any`) to the parameter to hold in its place, if any.
type ReplaceShard = dyn Fn(ParamId, &dyn Any) -> Result<Option<Box<dyn Any>>, ZeroError> + Send + Sync;

impl std::fmt::Debug for AfterStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AfterStep")
    }
}

impl Sharding {
    /// How `unit` is gathered on the collective's backend `I`.
    /// `source`: the store the shard's values are read from, when the parameter holds its
    /// placeholder.
    pub(super) fn gather<I: Backend>(
        &self,
        unit: &Unit,
        source: Option<Arc<ParamStore>>,
    ) -> Result<UnitGather<I>, ZeroError> {
        Ok(UnitGather {
            comm: self.comm.get::<I>()?.clone(),
            prefetch: self.prefetcher::<I>().map(|p| (p, unit.id)),
            grad_dtype: self.grad_dtype,
            source,
            subject: unit.subject(),
        })
    }

    /// The store holding the values of a shard whose parameter's value is `shard`, if the unit
    /// is offloaded and the parameter holds the store's placeholder.
    pub(super) fn source(&self, shard: &dyn Any) -> Option<Arc<ParamStore>> {
        self.store.get().filter(|s| s.stands_for(shard)).cloned()
    }

    /// The unit's prefetch schedule on the collective's backend `I`, if it has one.
    pub(super) fn prefetcher<I: Backend>(&self) -> Option<Arc<Prefetcher<I>>> {
        self.prefetch.get()?.clone().downcast::<Prefetcher<I>>().ok()
    }
}

/// A unit's whole vector as gathered from the shard value `key` names (a tensor of the
/// collective's backend).
struct Kept {
    key: u64,
    whole: Box<dyn Any + Send + Sync>,
}

/// What every copy of one unit shares (a training model, its `valid()` copy, clones).
#[derive(Debug)]
pub(super) struct Unit {
    /// A number no other unit of the process has.
    pub(super) id: u64,
    /// The unit's place among the model's units in visit order, the same on every rank: how
    /// its collectives name it to the peers. Set by every cut of a whole model.
    pub(super) ordinal: std::sync::atomic::AtomicU32,
    pub(super) shapes: Vec<Vec<usize>>,
    pub(super) numel: usize,
    pub(super) sharding: std::sync::OnceLock<Sharding>,
    /// The kept whole vector (`Sharding::keep`).
    kept: std::sync::Mutex<Option<Kept>>,
    /// The unit's values were changed by [`ZeroModule::modify`] since the optimizer last
    /// looked ([`take_modified`](super::take_modified)).
    pub(super) modified: std::sync::atomic::AtomicBool,
    /// The names of the module's parameters that did not train when it was wrapped, where
    /// others did: a unit trains whole or not at all, so its forward refuses.
    partly_frozen: Vec<String>,
    /// The module holds a `ZeroModule`: units do not nest, so its forward refuses.
    nested: bool,
}

impl std::fmt::Debug for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Kept({})", self.key)
    }
}

impl Unit {
    /// The unit as its collectives name it (unnamed before a cut numbered it).
    pub(super) fn subject(&self) -> zero_core::comm::Subject {
        match self.ordinal.load(std::sync::atomic::Ordering::Relaxed) {
            u32::MAX => zero_core::comm::Subject::Unnamed,
            n => zero_core::comm::Subject::Unit(n),
        }
    }
}

/// Every unit by the id of its flat parameter: how [`shard_units`](super::shard_units) and the optimizer find a
/// unit from a parameter. Weak: a unit (and its ranks) lives as long as a module holds it.
pub(super) fn units() -> &'static std::sync::Mutex<std::collections::HashMap<ParamId, std::sync::Weak<Unit>>> {
    static UNITS: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<ParamId, std::sync::Weak<Unit>>>> =
        std::sync::OnceLock::new();
    UNITS.get_or_init(Default::default)
}

pub(super) fn unit(id: ParamId) -> Option<Arc<Unit>> {
    units()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&id)
        .and_then(std::sync::Weak::upgrade)
}

/// The flat parameters of `module`'s units changed by [`ZeroModule::modify`] since the last
/// call (each unit's mark is cleared): what `ZeroOptimizer` takes as new masters.
pub(crate) fn take_modified<B: Backend, M: Module<B>>(module: &M) -> Vec<ParamId> {
    struct Marked(Vec<ParamId>);
    impl<B: Backend> burn::module::ModuleVisitor<B> for Marked {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if unit(param.id).is_some_and(|u| u.modified.swap(false, std::sync::atomic::Ordering::SeqCst)) {
                self.0.push(param.id);
            }
        }
    }
    let mut marked = Marked(Vec::new());
    module.visit(&mut marked);
    marked.0
}

/// A module `M` of backend `B` held as one flat vector of its float parameters (visit order):
/// whole until [`shard_units`](super::shard_units) (or [`crate::initialize`] at stage 3) cuts it, then this rank's
/// shard of it (zero-padded to a multiple of the ranks, cut in equal contiguous shards). The
/// module itself is kept as a skeleton: its structure and parameter ids, with empty tensors.
///
/// A model written for Burn gets ZeRO stage 3 by wrapping fields: `block: Block<B>` becomes
/// `block: ZeroModule<B, Block<B>>`, built with `ZeroModule::new(config.init(device))`, and its
/// forward `self.block.unshard(&x)?.forward(x)`.
///
/// Under `offload_param` the shard lives in host memory or a file and the parameter holds a
/// placeholder (see [`ParamPlace`](super::ParamPlace)): a Burn record of the training model
/// carries the stored values, but one of its `valid()` copy does not (Burn drops the
/// parameter's save hook there: it would hold the placeholder's NaNs), so save the training
/// model, a checkpoint (`ZeroOptimizer::save_checkpoint`) or the gathered weights
/// (`save_16bit_model`).
#[derive(Module, Debug)]
pub struct ZeroModule<B: Backend, M> {
    /// `M` with every float parameter an empty tensor.
    skeleton: M,
    /// The unit's flat parameters, or this rank's shard of them once sharded: the only
    /// parameter that holds values (and gets a gradient). A loaded record keeps its id.
    shard: UnitParam<B>,
    #[module(skip)]
    unit: Arc<Unit>,
}

impl<B, M> ZeroModule<B, M>
where
    B: ShardBackend,
    M: Module<B>,
{
    /// `module` as one unit, whole: it trains as an ordinary replicated parameter until
    /// [`shard_units`](super::shard_units) cuts it over the ranks.
    pub fn new(module: M) -> Self {
        let mut values = Vec::new();
        read_values::<B, _>(&module, |_, v| values.extend(v));
        let described = crate::params::describe::<B, _>(&module);
        let shapes: Vec<Vec<usize>> = described.iter().map(|(_, spec)| spec.shape.clone()).collect();
        // The unit trains whole, or not at all: the names of the parameters that do not train
        // (frozen, or running statistics), when others do.
        let trains = crate::params::trains::<B, _>(&module);
        let frozen: Vec<String> = described
            .iter()
            .zip(&trains)
            .filter(|(_, &t)| !t)
            .map(|((_, spec), _)| spec.name.clone())
            .collect();
        let all_frozen = !trains.is_empty() && frozen.len() == trains.len();
        let nested = super::contains_zero_module::<B, _>(&module);
        let device = module.devices().into_iter().next().unwrap_or_default();
        let numel = values.len();
        let flat = Tensor::<B, 1>::from_data(TensorData::new(values, [numel]), &device);
        let skeleton = module.map(&mut Emptied);
        let shard = Param::from_tensor(flat);
        let shard = if all_frozen {
            shard.set_require_grad(false)
        } else {
            shard
        };
        static NEXT_UNIT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let unit = Arc::new(Unit {
            id: NEXT_UNIT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            ordinal: std::sync::atomic::AtomicU32::new(u32::MAX),
            shapes,
            numel,
            sharding: std::sync::OnceLock::new(),
            kept: std::sync::Mutex::new(None),
            modified: std::sync::atomic::AtomicBool::new(false),
            partly_frozen: if all_frozen { Vec::new() } else { frozen },
            nested,
        });
        let mut registry = units().lock().unwrap_or_else(|e| e.into_inner());
        // Units whose models are gone leave dead entries: drop them as the registry doubles.
        if registry.len() >= 64 && registry.len().is_power_of_two() {
            registry.retain(|_, unit| unit.strong_count() > 0);
        }
        registry.insert(shard.id, Arc::downgrade(&unit));
        drop(registry);
        ZeroModule {
            skeleton,
            shard: UnitParam(shard),
            unit,
        }
    }

    /// The unit's flat parameters, or this rank's shard of them once sharded.
    pub fn shard(&self) -> &Param<Tensor<B, 1>> {
        &self.shard
    }

    /// Whether the unit is cut over the ranks (stage 3) rather than held whole.
    pub fn is_sharded(&self) -> bool {
        self.sharding().is_some()
    }

    /// Where the unit's parameters sit in its flat vector.
    pub fn layout(&self) -> UnitLayout {
        UnitLayout {
            shapes: self.unit.shapes.clone(),
            shard_len: match self.sharding() {
                Some(s) => shard_len(self.unit.numel, s.world),
                None => self.unit.numel,
            },
        }
    }

    /// The ranks this copy is cut over: `None` while it holds the whole vector (also for a copy
    /// taken before the unit was sharded).
    fn sharding(&self) -> Option<&Sharding> {
        let sharding = self.unit.sharding.get()?;
        (self.shard.lazy_shape().num_elements() == shard_len(self.unit.numel, sharding.world)).then_some(sharding)
    }

    /// The module with its whole parameters, for one forward that starts from `input`. A sharded
    /// unit gathers every rank's shard (under autodiff, the input orders the gradient's
    /// reduce-scatter right after the unit's backward).
    pub fn unshard<const D: usize>(&self, input: &Tensor<B, D>) -> Result<M, ZeroError> {
        self.check_trains_whole()?;
        self.whole(Some(input))
    }

    /// A unit trains whole: one whose module had some parameters frozen (or running statistics,
    /// a BatchNorm's) would train them through its flat parameter, or lose their updates. And it
    /// holds what its unit can hold: its whole vector, or this rank's shard once cut (a Burn
    /// record of another world size or cut loaded into it holds neither).
    fn check_trains_whole(&self) -> Result<(), ZeroError> {
        if self.unit.nested {
            return Err(super::cut::nested_unit());
        }
        let held = self.shard.lazy_shape().num_elements();
        if !self.unit.holds(held) {
            let world = self.unit.sharding.get().map(|s| s.world);
            return Err(wrong_length("a ZeroModule", held, self.unit.numel, world));
        }
        if self.unit.partly_frozen.is_empty() {
            return Ok(());
        }
        Err(ZeroError::Usage(format!(
            "a ZeroModule holds parameters that do not train ({}) beside ones that do: a unit trains whole. \
             Freeze the whole unit (`unit.no_grad()`), or keep those layers (frozen ones, BatchNorm) outside \
             ZeroModule",
            self.unit.partly_frozen.join(", ")
        )))
    }

    /// [`ZeroModule::unshard`] for a unit whose forward starts from no float tensor (token ids,
    /// the model's first unit): its gradient is reduce-scattered when the backward reaches it.
    pub fn gathered(&self) -> Result<M, ZeroError> {
        self.check_trains_whole()?;
        self.whole::<1>(None)
    }

    /// DeepSpeed's `GatheredParameters` with a modifier rank: the unit with the values
    /// `change` gives its whole module on rank `modifier_rank`, written into every rank's
    /// shard. Every rank calls it at the same point (it gathers the unit and broadcasts rank
    /// `modifier_rank`'s result), between steps; `change` runs on every rank, and only the
    /// modifier's result counts. Returns the unit to hold in place of this one (the same
    /// parameter id). `ZeroOptimizer` takes the new values as its fp32 masters at its next step,
    /// keeping the optimizer's moments. A unit held whole (not cut) has no ranks to hear from:
    /// each rank keeps its own result, so make the same change on every rank.
    ///
    /// ```ignore
    /// // Rank 0 rescales the block's MLP output weights; every rank's shard gets the result.
    /// model.blocks[3] = model.blocks[3].modify(0, |mut block| {
    ///     block.mlp.c_proj.weight = block.mlp.c_proj.weight.map(|w| w * 0.5);
    ///     block
    /// })?;
    /// ```
    pub fn modify(&self, modifier_rank: usize, change: impl FnOnce(M) -> M) -> Result<Self, ZeroError> {
        let checked = self.check_trains_whole();
        // A unit that only this rank holds amiss (a record it loaded): every rank fails, none
        // waits in the gather below.
        if let Some(comm) = self
            .unit
            .sharding
            .get()
            .map(|s| s.comm.get::<B::Collective>())
            .transpose()?
        {
            let mut failed = [f32::from(checked.is_err())];
            comm.all_reduce_scalars(&mut failed, zero_core::comm::ReduceOp::Max)?;
            if failed[0] > 0.0 {
                return Err(checked.err().unwrap_or_else(|| {
                    ZeroError::Usage("ZeroModule::modify: another rank's unit refused it (see its error)".into())
                }));
            }
        }
        checked?;
        self.register();
        let sizes: Vec<usize> = self.unit.shapes.iter().map(|s| s.iter().product()).collect();
        let numel = self.unit.numel;
        let shard = self.shard.val();
        let sharding = self.sharding();
        let store = sharding.and_then(|s| s.source(&shard));
        // An offloaded shard's dtype is its store's (the placeholder's is not the values').
        let dtype = store.as_ref().map_or(shard.dtype(), |s| s.dtype());
        let shard = B::collective_value(shard);
        let shard = match &store {
            Some(store) => store.read_tensor::<B::Collective>(&shard.device())?,
            None => shard,
        };
        let comm = sharding.map(|s| s.comm.get::<B::Collective>().cloned()).transpose()?;
        if let Some(comm) = &comm {
            if modifier_rank >= comm.world_size() {
                return Err(ZeroError::Usage(format!(
                    "ZeroModule::modify: modifier rank {modifier_rank} of {} ranks",
                    comm.world_size()
                )));
            }
        }
        // The whole values (gathered from every rank's shard), as the module.
        let whole = match &comm {
            Some(comm) => comm.all_gather(shard)?,
            None => shard,
        };
        let device = whole.device();
        let mut at = 0;
        let parts: VecDeque<_> = sizes
            .iter()
            .zip(&self.unit.shapes)
            .map(|(&n, shape)| {
                let part = B::from_collective(whole.clone().narrow(0, at, n));
                at += n;
                (part, Shape::from(shape.clone()))
            })
            .collect();
        drop(whole);
        let changed = change(self.skeleton.clone().map(&mut Filled(parts)));
        let mut values = Vec::with_capacity(numel);
        read_values::<B, M>(&changed, |_, v| values.extend(v));
        if values.len() != numel {
            return Err(ZeroError::Usage(format!(
                "ZeroModule::modify: the changed module has {} parameter elements where the unit has {numel}: change \
                 values, not shapes",
                values.len()
            )));
        }
        let on_device = |v: Vec<f32>| {
            let n = v.len();
            Tensor::<B::Collective, 1>::from_data(TensorData::new(v, [n]).convert_dtype(dtype), (&device, dtype))
        };
        let id = self.shard.id;
        let shard = match (&comm, sharding) {
            (Some(comm), Some(s)) => {
                let len = shard_len(numel, s.world);
                values.resize(len * s.world, 0.0);
                let whole = comm.broadcast(on_device(values), modifier_rank)?;
                if s.keep {
                    Param::initialized(id, self.unit.keep_whole::<B>(whole, comm.rank()))
                } else {
                    let mine = whole.narrow(0, comm.rank() * len, len);
                    match s.store.get() {
                        // Offloaded: the new shard goes to its store, the parameter holds a new
                        // placeholder.
                        Some(store) => {
                            store.write(mine.into_data())?;
                            placeholder::<B>(id, store, &device)
                        }
                        None => Param::initialized(id, B::from_collective(mine)),
                    }
                }
            }
            _ => Param::initialized(id, B::from_collective(on_device(values))),
        };
        // A frozen unit stays frozen.
        let shard = if self.shard.is_require_grad() {
            shard
        } else {
            shard.set_require_grad(false)
        };
        self.unit.modified.store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(ZeroModule {
            skeleton: self.skeleton.clone(),
            shard: UnitParam(shard),
            unit: self.unit.clone(),
        })
    }

    fn whole<const D: usize>(&self, input: Option<&Tensor<B, D>>) -> Result<M, ZeroError> {
        self.register();
        let sizes: Vec<usize> = self.unit.shapes.iter().map(|s| s.iter().product()).collect();
        let sharding = self.sharding();
        let shard = self.shard.val();
        let gather = sharding
            .map(|s| s.gather::<B::Collective>(&self.unit, s.source(&shard)))
            .transpose()?;
        let kept = match (sharding, &gather) {
            (Some(s), Some(gather)) if s.keep => self.kept(&shard, gather)?,
            _ => None,
        };
        let parts = B::gather_parts(shard, input, gather.as_ref(), kept, &sizes)?;
        let parts: VecDeque<_> = parts
            .into_iter()
            .zip(&self.unit.shapes)
            .map(|(part, shape)| (part, Shape::from(shape.clone())))
            .collect();
        Ok(self.skeleton.clone().map(&mut Filled(parts)))
    }
}

/// `what`, a unit of `numel` elements (cut over `world` ranks, if it is) whose parameter holds
/// `held`: a Burn record saved from another state of the unit was loaded into it.
pub(super) fn wrong_length(what: &str, held: usize, numel: usize, world: Option<usize>) -> ZeroError {
    let expected = match world {
        Some(w) => format!("{numel} (whole) or {} (this rank's shard of {w})", shard_len(numel, w)),
        None => format!("{numel} (whole)"),
    };
    ZeroError::Usage(format!(
        "{what} holds {held} elements where its unit holds {expected}: a Burn record of a ZeroModule holds \
         what the unit held when it was saved (once cut at stage 3, one rank's shard at that world size), so it \
         loads into the same rank at the same world size. Load weights into the module before wrapping it, or \
         resume with ZeroOptimizer::load_checkpoint, which re-cuts the shards for any world size"
    ))
}

impl Unit {
    /// Whether a parameter of `len` elements is what this unit can hold: its whole vector, or
    /// a rank's shard once cut.
    pub(super) fn holds(&self, len: usize) -> bool {
        len == self.numel
            || self
                .sharding
                .get()
                .is_some_and(|s| len == shard_len(self.numel, s.world))
    }

    /// Keeps `whole` (this unit's whole vector, every rank's shard in rank order) between steps,
    /// and returns rank `rank`'s shard as a view of it (no copy where the backend slices by
    /// reference), as a parameter: the key the kept vector is found by.
    pub(super) fn keep_whole<B: ShardBackend>(&self, whole: Tensor<B::Collective, 1>, rank: usize) -> Tensor<B, 1> {
        let sharding = self.sharding.get();
        let len = sharding.map_or(self.numel, |s| shard_len(self.numel, s.world));
        let shard = B::from_collective(whole.clone().narrow(0, rank * len, len));
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        *kept = B::value_key(&shard).map(|key| Kept {
            key,
            whole: Box::new(whole),
        });
        shard
    }
}

impl<B, M> ZeroModule<B, M>
where
    B: ShardBackend,
    M: Module<B>,
{
    /// Makes the registry find this unit by its flat parameter's id: a module mapper that gave
    /// the parameter a new id leaves one the registry has not seen (a loaded Burn record keeps
    /// the unit's, [`UnitParam`]).
    fn register(&self) {
        let id = self.shard.id;
        let mut registry = units().lock().unwrap_or_else(|e| e.into_inner());
        let known = registry
            .get(&id)
            .and_then(std::sync::Weak::upgrade)
            .is_some_and(|u| Arc::ptr_eq(&u, &self.unit));
        if !known {
            registry.insert(id, Arc::downgrade(&self.unit));
        }
    }

    /// The unit's whole vector for `shard`'s value: the one kept since it was gathered (at the
    /// cut, or by the step that wrote it), or gathered now (a value written elsewhere) and kept
    /// in place of the last value's. `None`
    /// where the backend cannot tell values apart (the caller gathers).
    fn kept(
        &self,
        shard: &Tensor<B, 1>,
        gather: &UnitGather<B::Collective>,
    ) -> Result<Option<Tensor<B::Collective, 1>>, ZeroError> {
        let Some(key) = B::value_key(shard) else {
            return Ok(None);
        };
        let mut kept = self.unit.kept.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = kept.as_ref().filter(|k| k.key == key) {
            if let Some(whole) = k.whole.downcast_ref::<Tensor<B::Collective, 1>>() {
                let whole = whole.clone();
                drop(kept);
                // A forward without any collective would let a rank start its backward (whose
                // reduce-scatters wait for every rank, inside burn 0.21's lock on its graph)
                // while another rank, a thread of the same process, is still in the cleanup
                // that ends its last backward, which locks every thread's graph: both would
                // wait forever. One scalar all-reduce keeps the ranks in step, as the gathers
                // of stage 3 do. Ranks in processes of their own (NCCL) need none.
                if gather.comm.ranks_may_share_a_process() {
                    gather
                        .comm
                        .all_reduce_scalars(&mut [0.0], zero_core::comm::ReduceOp::Sum)?;
                }
                return Ok(Some(whole));
            }
        }
        // The last value's vector goes first: one unit's whole at a time, not two.
        *kept = None;
        let whole = gather.all_gather(B::collective_value(shard.clone()), key, Phase::Forward)?;
        *kept = Some(Kept {
            key,
            whole: Box::new(whole.clone()),
        });
        Ok(Some(whole))
    }
}
