//! `ZeroModule`: a Burn module whose float parameters live as one flat vector, cut into one shard
//! per rank at stage 3 ([`shard_units`]), itself a Burn `Module` that can be a field of any model. Its whole
//! module is reached for one forward through [`ZeroModule::unshard`]; under autodiff the gather
//! is the differentiable op of [`gather`](super::gather), so `loss.backward()` leaves the
//! shard's gradient (averaged over the ranks) where Burn's optimizers and `GradientsParams` look
//! for it.

use super::backend::{ShardBackend, ShardComm};
use super::gather::{UnitComm, UnitGather};
use super::prefetch::{Phase, Prefetcher};
use crate::error::ZeroError;
use crate::params::read_values;
use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{Shape, Tensor, TensorData};
use std::any::Any;
use std::collections::VecDeque;
use std::sync::Arc;
use zero_core::partition::ParamSpec;

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
struct Sharding {
    comm: ShardComm,
    world: usize,
    /// The whole vector is gathered once per value of the shard (after each step) and kept
    /// until the next (stage 2), rather than gathered for every use (stage 3).
    keep: bool,
    /// The schedule that gathers this unit ahead of its use (a `Prefetcher` of the
    /// collective's backend), when the cut asked for one.
    prefetch: std::sync::OnceLock<Arc<dyn Any + Send + Sync>>,
    /// What a new shard value written by a step does to the unit ([`after_step`]).
    after_step: std::sync::OnceLock<AfterStep>,
}

/// Takes a unit's new shard (a `Tensor<B, 1>` of the backend the unit was cut for, hence `Any`)
/// and returns the tensor to hold instead, if any: at stage 2 the shard as a view of its whole
/// vector, gathered at once; otherwise the prefetch schedule is told the value.
struct AfterStep(Box<dyn Fn(&dyn Any) -> Result<Option<Box<dyn Any>>, ZeroError> + Send + Sync>);

impl std::fmt::Debug for AfterStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AfterStep")
    }
}

impl Sharding {
    /// How the unit numbered `unit` is gathered on the collective's backend `I`.
    fn gather<I: Backend>(&self, unit: u64) -> Result<UnitGather<I>, ZeroError> {
        Ok(UnitGather {
            comm: self.comm.get::<I>()?.clone(),
            prefetch: self
                .prefetch
                .get()
                .and_then(|p| p.clone().downcast::<Prefetcher<I>>().ok())
                .map(|p| (p, unit)),
        })
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
struct Unit {
    /// A number no other unit of the process has.
    id: u64,
    shapes: Vec<Vec<usize>>,
    numel: usize,
    sharding: std::sync::OnceLock<Sharding>,
    /// The kept whole vector (`Sharding::keep`).
    kept: std::sync::Mutex<Option<Kept>>,
}

impl std::fmt::Debug for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Kept({})", self.key)
    }
}

/// Every unit by the id of its flat parameter: how [`shard_units`] and the optimizer find a
/// unit from a parameter. Weak: a unit (and its ranks) lives as long as a module holds it.
fn units() -> &'static std::sync::Mutex<std::collections::HashMap<ParamId, std::sync::Weak<Unit>>> {
    static UNITS: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<ParamId, std::sync::Weak<Unit>>>> =
        std::sync::OnceLock::new();
    UNITS.get_or_init(Default::default)
}

fn unit(id: ParamId) -> Option<Arc<Unit>> {
    units()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&id)
        .and_then(std::sync::Weak::upgrade)
}

/// A module `M` of backend `B` held as one flat vector of its float parameters (visit order):
/// whole until [`shard_units`] (or [`crate::initialize`] at stage 3) cuts it, then this rank's
/// shard of it (zero-padded to a multiple of the ranks, cut in equal contiguous shards). The
/// module itself is kept as a skeleton: its structure and parameter ids, with empty tensors.
///
/// A model written for Burn gets ZeRO stage 3 by wrapping fields: `block: Block<B>` becomes
/// `block: ZeroModule<B, Block<B>>`, built with `ZeroModule::new(config.init(device))`, and its
/// forward `self.block.unshard(&x)?.forward(x)`.
#[derive(Module, Debug)]
pub struct ZeroModule<B: Backend, M> {
    /// `M` with every float parameter an empty tensor.
    skeleton: M,
    /// The unit's flat parameters, or this rank's shard of them once sharded: the only
    /// parameter that holds values (and gets a gradient).
    shard: Param<Tensor<B, 1>>,
    #[module(skip)]
    unit: Arc<Unit>,
}

impl<B, M> ZeroModule<B, M>
where
    B: ShardBackend,
    M: Module<B>,
{
    /// `module` as one unit, whole: it trains as an ordinary replicated parameter until
    /// [`shard_units`] cuts it over the ranks.
    pub fn new(module: M) -> Self {
        let mut values = Vec::new();
        read_values::<B, _>(&module, |_, v| values.extend(v));
        let shapes: Vec<Vec<usize>> = crate::params::describe::<B, _>(&module)
            .into_iter()
            .map(|(_, spec)| spec.shape)
            .collect();
        let device = module.devices().into_iter().next().unwrap_or_default();
        let numel = values.len();
        let flat = Tensor::<B, 1>::from_data(TensorData::new(values, [numel]), &device);
        let skeleton = module.map(&mut Emptied);
        let shard = Param::from_tensor(flat);
        static NEXT_UNIT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let unit = Arc::new(Unit {
            id: NEXT_UNIT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            shapes,
            numel,
            sharding: std::sync::OnceLock::new(),
            kept: std::sync::Mutex::new(None),
        });
        let mut registry = units().lock().unwrap_or_else(|e| e.into_inner());
        // Units whose models are gone leave dead entries: drop them as the registry doubles.
        if registry.len() >= 64 && registry.len().is_power_of_two() {
            registry.retain(|_, unit| unit.strong_count() > 0);
        }
        registry.insert(shard.id, Arc::downgrade(&unit));
        drop(registry);
        ZeroModule { skeleton, shard, unit }
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
        self.whole(Some(input))
    }

    /// [`ZeroModule::unshard`] for a unit whose forward starts from no float tensor (token ids,
    /// the model's first unit): its gradient is reduce-scattered when the backward reaches it.
    pub fn gathered(&self) -> Result<M, ZeroError> {
        self.whole::<1>(None)
    }

    fn whole<const D: usize>(&self, input: Option<&Tensor<B, D>>) -> Result<M, ZeroError> {
        self.register();
        let sizes: Vec<usize> = self.unit.shapes.iter().map(|s| s.iter().product()).collect();
        let sharding = self.sharding();
        let gather = sharding.map(|s| s.gather::<B::Collective>(self.unit.id)).transpose()?;
        let shard = self.shard.val();
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

impl Unit {
    /// Keeps `whole` (this unit's whole vector, every rank's shard in rank order) between steps,
    /// and returns rank `rank`'s shard as a view of it (no copy where the backend slices by
    /// reference), as a parameter: the key the kept vector is found by.
    fn keep_whole<B: ShardBackend>(&self, whole: Tensor<B::Collective, 1>, rank: usize) -> Tensor<B, 1> {
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
    /// Makes the registry find this unit by its flat parameter's id: a Burn record loaded into
    /// the module (`load_record`) gives the parameter the record's id, which the registry has
    /// not seen.
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
                // of stage 3 do.
                gather
                    .comm
                    .all_reduce_scalars(&mut [0.0], zero_core::comm::ReduceOp::Sum)?;
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

/// How [`shard_units_with`] cuts a model's units.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UnitPlan {
    /// Units of fewer elements stay whole, as replicated parameters (DeepSpeed's
    /// `stage3_param_persistence_threshold`).
    pub min_numel: usize,
    /// Each unit keeps its whole vector between steps (ZeRO stage 2): gathered at its first
    /// use after each step and kept, so forward and backward gather nothing more, while its
    /// gradient is reduce-scattered to the rank's shard in backward as at stage 3.
    pub keep_gathered: bool,
    /// Elements of whole vectors gathered ahead of their use (DeepSpeed's
    /// `stage3_prefetch_bucket_size`, with `overlap_comm`): the units that came next the last
    /// time, in forward and again in backward (see `prefetch`'s module docs). 0: none.
    pub prefetch: usize,
}

/// `model` with every [`ZeroModule`] of at least `min_numel` elements cut over the ranks of
/// `comm`, gathered for every use (stage 3) and nothing prefetched: [`shard_units_with`] with
/// only [`UnitPlan::min_numel`] set.
pub fn shard_units<B: ShardBackend, M: Module<B>>(
    model: M,
    comm: UnitComm<B::Collective>,
    min_numel: usize,
) -> Result<M, ZeroError> {
    shard_units_with(
        model,
        comm,
        &UnitPlan {
            min_numel,
            ..UnitPlan::default()
        },
    )
}

/// `model` with every [`ZeroModule`] of at least `plan.min_numel` elements cut over the ranks
/// of `comm`: each rank keeps its shard of the unit's flat vector (the model must be the same
/// on every rank: one seed, or loaded). Smaller units stay whole, as replicated parameters. A
/// unit already cut over `comm`'s ranks is kept (and joins the plan's prefetch schedule if it
/// has none); one cut otherwise, or held whole after it was cut (a unit in two fields), is an
/// error.
pub fn shard_units_with<B: ShardBackend, M: Module<B>>(
    model: M,
    comm: UnitComm<B::Collective>,
    plan: &UnitPlan,
) -> Result<M, ZeroError> {
    struct Cut<'a, B: ShardBackend> {
        comm: UnitComm<B::Collective>,
        plan: &'a UnitPlan,
        prefetcher: Option<Arc<Prefetcher<B::Collective>>>,
        error: Option<ZeroError>,
    }
    impl<B: ShardBackend> Cut<'_, B> {
        /// Puts `unit` in the cut's prefetch schedule (unless it is in one), and says what a
        /// step's new shard does to it.
        fn join(&self, unit: &Arc<Unit>) {
            let Some(sharding) = unit.sharding.get() else { return };
            if let Some(prefetcher) = &self.prefetcher {
                let _ = sharding.prefetch.set(prefetcher.clone());
            }
            let weak = Arc::downgrade(unit);
            let _ = sharding.after_step.set(AfterStep(Box::new(move |value: &dyn Any| {
                let (Some(shard), Some(unit)) = (value.downcast_ref::<Tensor<B, 1>>(), weak.upgrade()) else {
                    return Ok(None);
                };
                let (Some(sharding), Some(key)) = (unit.sharding.get(), B::value_key(shard)) else {
                    return Ok(None);
                };
                if sharding.keep {
                    let comm = sharding.comm.get::<B::Collective>()?;
                    let whole = comm.all_gather(B::collective_value(shard.clone()))?;
                    return Ok(Some(Box::new(unit.keep_whole::<B>(whole, comm.rank())) as Box<dyn Any>));
                }
                if let Some(prefetcher) = sharding.gather::<B::Collective>(unit.id)?.prefetch {
                    prefetcher.0.note(unit.id, key, B::collective_value(shard.clone()));
                }
                Ok(None)
            })));
        }
    }
    impl<B: ShardBackend> ModuleMapper<B> for Cut<'_, B> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let Some(unit) = unit(param.id).filter(|u| u.numel >= self.plan.min_numel) else {
                return param;
            };
            let world = self.comm.world_size();
            // Already this rank's shard (a model built unit by unit, each cut as it was read):
            // kept as it is.
            let cut_for = unit.sharding.get().map(|s| s.world);
            if cut_for == Some(world) && param.lazy_shape().num_elements() == shard_len(unit.numel, world) {
                self.join(&unit);
                return param;
            }
            let sharding = Sharding {
                comm: ShardComm::new(self.comm.clone()),
                world,
                keep: self.plan.keep_gathered,
                prefetch: std::sync::OnceLock::new(),
                after_step: std::sync::OnceLock::new(),
            };
            if unit.sharding.set(sharding).is_err() {
                self.error.get_or_insert(ZeroError::Usage(
                    "a ZeroModule was sharded twice: shard a model once (zero_burn::initialize does), and keep a \
                     unit used in two places in one field (use it twice, as ShardedGpt2 does its embedding)"
                        .into(),
                ));
                return param;
            }
            self.join(&unit);
            let len = shard_len(unit.numel, world);
            let id = param.id;
            // Cut on the host, once: ops on the tracked whole vector would leave autodiff
            // nodes (and, under checkpointing, their inputs) alive.
            let device = param.lazy_device();
            let data = param.val().into_data();
            let dtype = data.dtype;
            let whole = match data.convert::<f32>().into_vec::<f32>() {
                Ok(v) => v,
                Err(e) => {
                    self.error
                        .get_or_insert(ZeroError::Model(format!("reading a ZeroModule's parameters: {e:?}")));
                    return param;
                }
            };
            let rank = self.comm.rank();
            // In the dtype the unit was given (16-bit after `initialize` under bf16 or fp16).
            let on_device = |v: Vec<f32>| {
                let n = v.len();
                Tensor::<B, 1>::from_data(TensorData::new(v, [n]).convert_dtype(dtype), (&device, dtype))
            };
            let shard = if self.plan.keep_gathered {
                // Stage 2: every rank's values are here, so the whole vector is kept at once and
                // the shard is a view of it.
                let mut padded = whole;
                padded.resize(len * world, 0.0);
                let padded = B::collective_value(on_device(padded));
                unit.keep_whole::<B>(padded, rank)
            } else {
                let start = (rank * len).min(unit.numel);
                let end = ((rank + 1) * len).min(unit.numel);
                let mut mine = whole[start..end].to_vec();
                drop(whole);
                mine.resize(len, 0.0);
                on_device(mine).require_grad()
            };
            Param::initialized(id, Tensor::<B, D>::from_primitive(shard.into_primitive()))
        }
    }
    let prefetcher =
        (plan.prefetch > 0 && comm.world_size() > 1).then(|| Arc::new(Prefetcher::new(comm.clone(), plan.prefetch)));
    let mut cut = Cut::<B> {
        comm,
        plan,
        prefetcher,
        error: None,
    };
    let model = model.map(&mut cut);
    match cut.error {
        Some(e) => Err(e),
        None => Ok(model),
    }
}

/// Replaces each float parameter by an empty tensor of its rank, keeping its id.
struct Emptied;

impl<B: Backend> ModuleMapper<B> for Emptied {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let device = param.lazy_device();
        Param::initialized(param.id, Tensor::<B, D>::empty([0; D], &device))
    }
}

/// Fills each float parameter, in visit order, with the next flat part in its recorded shape.
struct Filled<B: Backend>(VecDeque<(Tensor<B, 1>, Shape)>);

impl<B: Backend> ModuleMapper<B> for Filled<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        match self.0.pop_front() {
            Some((part, shape)) => Param::initialized(param.id, part.reshape(shape)),
            // The layout is recorded from this module's own parameters: one part per parameter.
            None => unreachable!("a ZeroModule's skeleton has more float parameters than its layout"),
        }
    }
}

/// How an optimizer sees one float parameter of a model holding [`ZeroModule`]s.
#[derive(Clone, Debug, PartialEq)]
pub enum HeldParam {
    /// An ordinary parameter, named by its place in the model.
    Plain(ParamSpec),
    /// A unit's flat vector, or this rank's shard of it (`sharded`): the unit's parameters
    /// (visit order, contiguous in the flat vector), each named by its place in the model as if
    /// it were not wrapped (the `ZeroModule`'s own `skeleton` and `shard` fields leave no trace
    /// in a name).
    Unit { params: Vec<ParamSpec>, sharded: bool },
    /// An empty placeholder of a unit's skeleton: it holds no value.
    Skeleton,
}

/// Every float parameter of `module`, in visit order, with its id and what it holds
/// ([`HeldParam`]): the names a checkpoint of a model with `ZeroModule`s gives its weights, the
/// same as the unwrapped model's.
pub fn held_params<B: Backend, M: Module<B>>(module: &M) -> Vec<(ParamId, HeldParam)> {
    struct Visit {
        path: Vec<String>,
        /// Depth of the path at the skeleton being visited, and its parameters' names so far.
        skeleton: Option<usize>,
        names: Vec<String>,
        /// The next float parameter is a unit's flat vector.
        in_shard: bool,
        out: Vec<(ParamId, HeldParam)>,
    }
    impl Visit {
        fn name(&self, parts: &[String]) -> String {
            if parts.is_empty() {
                format!("param{}", self.out.len())
            } else {
                parts.join(".")
            }
        }
    }
    impl<B: Backend> burn::module::ModuleVisitor<B> for Visit {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            let in_unit = container_type == "Struct:ZeroModule";
            if in_unit && name == "skeleton" && self.skeleton.is_none() {
                self.skeleton = Some(self.path.len());
                self.names.clear();
            }
            self.in_shard = in_unit && name == "shard" && self.skeleton.is_none();
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
            if self.skeleton == Some(self.path.len()) {
                self.skeleton = None;
            }
            self.in_shard = false;
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(depth) = self.skeleton {
                // The unit's path, then the parameter's path inside its module.
                let parts: Vec<String> = self.path[..depth]
                    .iter()
                    .chain(&self.path[depth + 1..])
                    .cloned()
                    .collect();
                let name = self.name(&parts);
                self.names.push(name);
                self.out.push((param.id, HeldParam::Skeleton));
                return;
            }
            let spec = ParamSpec {
                name: self.name(&self.path),
                shape: param.lazy_shape().to_vec(),
            };
            let unit = unit(param.id).filter(|_| self.in_shard);
            let sharded = unit
                .as_ref()
                .and_then(|u| u.sharding.get().map(|s| spec.numel() == shard_len(u.numel, s.world)))
                .unwrap_or(false);
            let held = match unit {
                Some(unit) if unit.shapes.len() == self.names.len() => HeldParam::Unit {
                    params: std::mem::take(&mut self.names)
                        .into_iter()
                        .zip(&unit.shapes)
                        .map(|(name, shape)| ParamSpec {
                            name,
                            shape: shape.clone(),
                        })
                        .collect(),
                    sharded,
                },
                // A unit whose skeleton did not show its parameters (one nested in another):
                // its flat vector under its own name.
                Some(unit) => HeldParam::Unit {
                    params: vec![ParamSpec {
                        name: spec.name,
                        shape: vec![unit.numel],
                    }],
                    sharded,
                },
                None => HeldParam::Plain(spec),
            };
            self.out.push((param.id, held));
        }
    }
    let mut visit = Visit {
        path: Vec::new(),
        skeleton: None,
        names: Vec::new(),
        in_shard: false,
        out: Vec::new(),
    };
    module.visit(&mut visit);
    visit.out
}

/// Whether `module` holds a [`ZeroModule`] anywhere inside it.
pub fn contains_zero_module<B: Backend, M: Module<B>>(module: &M) -> bool {
    struct Find(bool);
    impl<B: Backend> burn::module::ModuleVisitor<B> for Find {
        fn enter_module(&mut self, _name: &str, container_type: &str) {
            // The container type Burn's derive names: `Struct:` and the type's name.
            self.0 |= container_type == "Struct:ZeroModule";
        }
    }
    let mut find = Find(false);
    module.visit(&mut find);
    find.0
}

/// The error of an engine that cannot run a model holding [`ZeroModule`]s: their shards differ
/// by rank and their gradients arrive reduced, so an engine that reduces them as replicas would
/// average different ranks' shards together. `Ok` for a model without them.
pub(crate) fn refuse_zero_modules<B: Backend, M: Module<B>>(module: &M, engine: &str) -> Result<(), ZeroError> {
    if contains_zero_module::<B, M>(module) {
        return Err(ZeroError::Config(format!(
            "{engine} does not step ZeroModule shards; train a model holding ZeroModules in a Burn loop with \
             zero_burn::ZeroOptimizer"
        )));
    }
    Ok(())
}

/// `module` after a step wrote its units' new shards: at stage 2 each unit's whole vector is
/// gathered now (ZeRO-2's all-gather of the updated parameters) and its shard held as a view of
/// it, so that forward gathers nothing and a rank holds each parameter once; otherwise each
/// unit's prefetch schedule learns the value the next forward gathers. Every rank calls it
/// with the same model, so the gathers are in the same order everywhere.
pub(crate) fn after_step<B: Backend, M: Module<B>>(module: M) -> Result<M, ZeroError> {
    struct After {
        error: Option<ZeroError>,
    }
    impl<B: Backend> ModuleMapper<B> for After {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let Some(unit) = unit(param.id) else { return param };
            let Some(sharding) = unit.sharding.get() else {
                return param;
            };
            let Some(hook) = sharding.after_step.get() else {
                return param;
            };
            // A copy from before the cut holds the whole vector, not a shard; after an error
            // the step fails, and nothing more is gathered.
            if param.lazy_shape().num_elements() != shard_len(unit.numel, sharding.world) || self.error.is_some() {
                return param;
            }
            let value = param.val();
            match (hook.0)(&value as &dyn Any) {
                Ok(Some(new)) => match new.downcast::<Tensor<B, D>>() {
                    Ok(new) => Param::initialized(param.id, *new),
                    Err(_) => param,
                },
                Ok(None) => param,
                Err(e) => {
                    self.error = Some(e);
                    param
                }
            }
        }
    }
    let mut after = After { error: None };
    let module = module.map(&mut after);
    match after.error {
        Some(e) => Err(e),
        None => Ok(module),
    }
}
