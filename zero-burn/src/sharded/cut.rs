//! Cutting a model's `ZeroModule`s over the ranks ([`shard_units_with`]) and what a step's new
//! shards do to them ([`after_step`]).

use super::backend::{ShardBackend, ShardComm};
use super::gather::UnitComm;
use super::module::{shard_len, unit, AfterStep, Sharding, Unit};
use super::offload::{placeholder, ParamPlace, Stash};
use super::prefetch::Prefetcher;
use crate::error::ZeroError;
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use std::any::Any;
use std::sync::Arc;

/// How [`shard_units_with`] cuts a model's units.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UnitPlan {
    /// Units of fewer elements stay whole, as replicated parameters (DeepSpeed's
    /// `stage3_param_persistence_threshold`).
    pub min_numel: usize,
    /// Each unit keeps its whole vector between steps (ZeRO stage 2), the rank's shard a view
    /// of it: kept by the cut, gathered again after each step from the shards a step wrote (or
    /// at the first use of a shard written otherwise), so forward and backward gather nothing,
    /// while its gradient is reduce-scattered to the rank's shard in backward as at stage 3.
    pub keep_gathered: bool,
    /// Elements of whole vectors gathered ahead of their use (DeepSpeed's
    /// `stage3_prefetch_bucket_size`, with `overlap_comm`): the units that came next the last
    /// time, in forward and again in backward (see `prefetch`'s module docs). 0: none.
    pub prefetch: usize,
    /// The dtype a unit's gradient is reduce-scattered in (DeepSpeed's
    /// `communication_data_type`), cast back to the shard's dtype after; `None`: its own.
    pub grad_dtype: Option<burn::tensor::DType>,
    /// Where each cut unit's shard is kept between uses instead of the device (DeepSpeed's
    /// `offload_param`): the parameter then holds a placeholder and every gather reads the
    /// shard from there (no prefetching for such units). `None`: on the device.
    pub offload_param: Option<ParamPlace>,
}

/// `model` with every [`ZeroModule`](super::ZeroModule) of at least `min_numel` elements cut over the ranks of
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

/// `model` with every [`ZeroModule`](super::ZeroModule) of at least `plan.min_numel` elements cut over the ranks
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
        stash: Option<Stash>,
        error: Option<ZeroError>,
        /// Units met so far: the next one's place among the model's units.
        ordinal: u32,
    }
    impl<B: ShardBackend> Cut<'_, B> {
        /// Puts `unit` in the cut's prefetch schedule (unless it is in one, or offloaded), and
        /// says what a step's new shard does to it.
        fn join(&self, unit: &Arc<Unit>) {
            let Some(sharding) = unit.sharding.get() else { return };
            if let (Some(prefetcher), None) = (&self.prefetcher, sharding.store.get()) {
                let _ = sharding.prefetch.set(prefetcher.clone());
            }
            let weak = Arc::downgrade(unit);
            let _ = sharding.after_step.set(AfterStep(Box::new(move |id, value: &dyn Any| {
                let (Some(shard), Some(unit)) = (value.downcast_ref::<Tensor<B, 1>>(), weak.upgrade()) else {
                    return Ok(None);
                };
                let (Some(sharding), Some(key)) = (unit.sharding.get(), B::value_key(shard)) else {
                    return Ok(None);
                };
                if let Some(store) = sharding.store.get() {
                    // The step wrote the shard into the parameter: into the store with it.
                    if store.stands_for(shard) {
                        return Ok(None);
                    }
                    let values = B::collective_value(shard.clone());
                    let device = values.device();
                    store.write(values.into_data())?;
                    return Ok(Some(Box::new(placeholder::<B>(id, store, &device)) as Box<dyn Any>));
                }
                if sharding.keep {
                    let comm = sharding.comm.get::<B::Collective>()?;
                    let whole = comm.all_gather_of(B::collective_value(shard.clone()), unit.subject())?;
                    let kept = Param::initialized(id, unit.keep_whole::<B>(whole, comm.rank()));
                    return Ok(Some(Box::new(kept) as Box<dyn Any>));
                }
                if let Some(prefetcher) = sharding.prefetcher::<B::Collective>() {
                    prefetcher.note(unit.id, key, B::collective_value(shard.clone()));
                }
                Ok(None)
            })));
        }
    }
    impl<B: ShardBackend> ModuleMapper<B> for Cut<'_, B> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let Some(unit) = unit(param.id) else { return param };
            // Numbered in visit order, as every rank visits the same model: what its
            // collectives call it.
            unit.ordinal.store(self.ordinal, std::sync::atomic::Ordering::Relaxed);
            self.ordinal += 1;
            // A unit without parameters (an activation) has nothing to cut.
            if unit.numel < self.plan.min_numel || unit.numel == 0 {
                return param;
            }
            let world = self.comm.world_size();
            // Already this rank's shard (a model built unit by unit, each cut as it was read):
            // kept as it is.
            let cut_for = unit.sharding.get().map(|s| s.world);
            if cut_for == Some(world) && param.lazy_shape().num_elements() == shard_len(unit.numel, world) {
                // Cut as it was drawn (zero.Init): offloaded now if the plan says so.
                let param = match (&mut self.stash, unit.sharding.get()) {
                    (Some(stash), Some(sharding)) if sharding.store.get().is_none() => {
                        let value = B::collective_value(Tensor::<B, 1>::from_primitive(param.val().into_primitive()));
                        match offload::<B, D>(stash, sharding, param.id, value) {
                            Ok(p) => p,
                            Err(e) => {
                                self.error.get_or_insert(e);
                                param
                            }
                        }
                    }
                    _ => param,
                };
                self.join(&unit);
                return param;
            }
            let sharding = Sharding {
                comm: ShardComm::new(self.comm.clone()),
                world,
                keep: self.plan.keep_gathered,
                prefetch: std::sync::OnceLock::new(),
                after_step: std::sync::OnceLock::new(),
                grad_dtype: self.plan.grad_dtype,
                store: std::sync::OnceLock::new(),
            };
            if unit.sharding.set(sharding).is_err() {
                self.error.get_or_insert(ZeroError::Usage(
                    "a ZeroModule was sharded twice: shard a model once (zero_burn::initialize does), and keep a \
                     unit used in two places in one field (use it twice, as ShardedGpt2 does its embedding)"
                        .into(),
                ));
                return param;
            }
            let len = shard_len(unit.numel, world);
            let id = param.id;
            // A frozen unit stays frozen.
            let trained = param.is_require_grad();
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
            // A unit inside another unit's module: the outer skeleton emptied its parameter.
            if whole.is_empty() && unit.numel > 0 {
                self.error.get_or_insert(nested_unit());
                return param;
            }
            if whole.len() != unit.numel {
                self.error.get_or_insert(super::module::wrong_length(
                    "a ZeroModule",
                    whole.len(),
                    unit.numel,
                    None,
                ));
                return param;
            }
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
                let mine = on_device(mine);
                if let (Some(stash), Some(sharding)) = (&mut self.stash, unit.sharding.get()) {
                    let param = offload::<B, D>(stash, sharding, id, B::collective_value(mine));
                    self.join(&unit);
                    return param.unwrap_or_else(|e| {
                        self.error.get_or_insert(e);
                        Param::initialized(id, Tensor::<B, D>::empty(super::skeleton::vacant_shape::<D>(), &device))
                    });
                }
                mine.require_grad()
            };
            self.join(&unit);
            let shard = Tensor::<B, D>::from_primitive(shard.into_primitive());
            Param::initialized(id, if trained { shard } else { shard.set_require_grad(false) })
        }
    }
    let prefetcher =
        (plan.prefetch > 0 && comm.world_size() > 1).then(|| Arc::new(Prefetcher::new(comm.clone(), plan.prefetch)));
    let stash = plan.offload_param.clone().map(|place| Stash::new(place, comm.rank()));
    let mut cut = Cut::<B> {
        comm,
        plan,
        prefetcher,
        stash,
        error: None,
        ordinal: 0,
    };
    let model = model.map(&mut cut);
    match cut.error {
        Some(e) => Err(e),
        None => Ok(model),
    }
}

/// A unit's shard `value` (of parameter `id`) moved into a store of `stash`, which `sharding`
/// keeps: the placeholder parameter to hold instead.
fn offload<B: ShardBackend, const D: usize>(
    stash: &mut Stash,
    sharding: &Sharding,
    id: burn::module::ParamId,
    value: Tensor<B::Collective, 1>,
) -> Result<Param<Tensor<B, D>>, ZeroError> {
    let device = value.device();
    let (len, dtype) = (value.dims()[0], value.dtype());
    let store = stash.store::<B>(value.into_data(), len, dtype)?;
    let _ = sharding.store.set(store.clone());
    of_rank(placeholder::<B>(id, &store, &device))
}

/// A unit's flat parameter as the `D`-dimensional parameter a mapper returns (it is one).
fn of_rank<B: Backend, const D: usize>(param: Param<Tensor<B, 1>>) -> Result<Param<Tensor<B, D>>, ZeroError> {
    (Box::new(param) as Box<dyn Any>)
        .downcast::<Param<Tensor<B, D>>>()
        .map(|p| *p)
        .map_err(|_| ZeroError::Model(format!("a ZeroModule's flat parameter has {D} dimensions, not 1")))
}

/// A `ZeroModule` whose module holds another: refused (each unit is one flat parameter).
pub(super) fn nested_unit() -> ZeroError {
    ZeroError::Usage(
        "a ZeroModule holds another ZeroModule: units do not nest (each is one flat parameter); wrap the inner \
         module's siblings one by one, or only the outer module"
            .into(),
    )
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
            let trained = param.is_require_grad();
            match (hook.0)(param.id, &value as &dyn Any) {
                Ok(Some(new)) => match new.downcast::<Param<Tensor<B, D>>>() {
                    // A frozen unit stays frozen.
                    Ok(new) if trained => *new,
                    Ok(new) => new.set_require_grad(false),
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
