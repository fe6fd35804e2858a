//! The optimizer's view of a module: which layout parameters each of its float parameters
//! holds, and the gradients Burn's loop hands over.

use crate::error::ZeroError;
use crate::layout::stage_layout;
use crate::memory::MemoryTracker;
use crate::settings::{EngineSettings, Stage};
use crate::sharded::{held_params, HeldParam, UNIT_ALIGNMENT};
use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use std::collections::HashMap;
use std::ops::Range;
use zero_core::partition::PartitionLayout;

/// A float parameter's gradient, flattened, on the inner backend.
pub(super) type FlatGrad<B> = Tensor<<B as AutodiffBackend>::InnerBackend, 1>;

/// By float parameter of a module (its index in visit order), the shard of a unit it holds.
pub(super) type Shards = HashMap<usize, Vec<f32>>;

/// What one float parameter of the module holds, in the optimizer's layout.
#[derive(Clone, Debug)]
pub(super) enum Holding {
    /// Layout parameter `.0`.
    Param(usize),
    /// A unit kept whole: layout parameters `.0` (contiguous), as one flat vector.
    Whole(Range<usize>),
    /// This rank's shard of a unit whose parameters are `params`: the owned slice of `group`.
    Shard { params: Range<usize>, group: usize },
    /// Nothing (a unit's skeleton).
    Nothing,
}

/// The optimizer's view of a module: the layout of its parameters (a `ZeroModule`'s named
/// one by one, as the unwrapped model's are, so that a checkpoint holds the model's own names
/// at every stage), and by float parameter of the module (visit order) its id and what it
/// holds.
#[derive(Clone)]
pub(super) struct ModuleView {
    pub(super) layout: PartitionLayout,
    pub(super) ids: Vec<ParamId>,
    pub(super) held: Vec<Holding>,
    /// By layout parameter, whether it trains now (`require_grad`).
    pub(super) trains: Vec<bool>,
}

/// The float parameters (visit order) of `module` that `view` holds and that do not train:
/// frozen (`require_grad` off), or a BatchNorm's running statistics (which Burn shows as
/// parameters). Their values are the module's, never the update's. Each running statistic's
/// last forward is synced in first (Burn keeps it per thread until the module's record is read),
/// except in a model whose unit shards are offloaded (`offload_param`): its record would read
/// every shard back from where it is kept, at every step, so there the statistics kept are one
/// forward behind the module's.
pub(super) fn not_trained<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M, view: &ModuleView) -> Vec<usize> {
    let trains = crate::params::trains::<B, M>(module);
    // A unit's skeleton holds nothing (its emptied parameters never train).
    let frozen: Vec<usize> = (0..trains.len().min(view.held.len()))
        .filter(|&i| !trains[i] && !matches!(view.held[i], Holding::Nothing))
        .collect();
    let offloaded = || {
        crate::sharded::stores_in_place::<B, M>(module)
            .iter()
            .any(Option::is_some)
    };
    if !frozen.is_empty() && !offloaded() {
        drop(module.clone().into_record());
    }
    frozen
}

impl ModuleView {
    /// The view of `module` at `settings`' stage over `world` ranks: [`stage_layout`] with each
    /// sharded unit's parameters one sharded group, cut as the unit cut its shards, and the
    /// parameters that do not train now grouped apart from those that do. With `built`, the
    /// layout a state was built with: its groups are kept while the parameters are the same
    /// (a parameter frozen or unfrozen since stays in its group).
    pub(super) fn of<B: AutodiffBackend, M: AutodiffModule<B>>(
        module: &M,
        settings: &EngineSettings,
        world: usize,
        built: Option<&PartitionLayout>,
    ) -> Self {
        let mut specs = Vec::new();
        let mut ids = Vec::new();
        let mut held = Vec::new();
        let mut sharded = Vec::new();
        let mut spec_trains = Vec::new();
        let module_trains = crate::params::trains::<B, M>(module);
        for (i, (id, param)) in held_params::<B, M>(module).into_iter().enumerate() {
            ids.push(id);
            let before = specs.len();
            held.push(match param {
                HeldParam::Plain(spec) => {
                    specs.push(spec);
                    Holding::Param(specs.len() - 1)
                }
                // A unit of a module without parameters (an activation) holds nothing.
                HeldParam::Unit { params, .. } if params.is_empty() => Holding::Nothing,
                HeldParam::Unit { params, sharded: cut } => {
                    let range = specs.len()..specs.len() + params.len();
                    specs.extend(params);
                    if cut {
                        sharded.push(range.clone());
                        Holding::Shard {
                            params: range,
                            group: usize::MAX,
                        }
                    } else {
                        Holding::Whole(range)
                    }
                }
                HeldParam::Skeleton => Holding::Nothing,
            });
            let trains = module_trains.get(i).copied().unwrap_or(true);
            spec_trains.resize(specs.len().max(before), trains);
        }
        let alignment = if sharded.is_empty() {
            settings.alignment
        } else {
            UNIT_ALIGNMENT
        };
        // A layout built before (or saved) is kept while it holds the same parameters and each
        // cut unit is one sharded group of its own, cut as the unit cuts its shards.
        let fits = |b: &&PartitionLayout| {
            b.params == specs
                && (sharded.is_empty() || b.alignment == UNIT_ALIGNMENT)
                && sharded.iter().all(|unit| {
                    let wanted: Vec<usize> = unit.clone().collect();
                    b.groups
                        .iter()
                        .any(|g| g.params == wanted && g.placement == zero_core::partition::Placement::Sharded)
                })
        };
        let layout = match built.filter(fits) {
            Some(built) => built.clone(),
            None => stage_layout(specs, &sharded, &spec_trains, alignment, settings, world),
        };
        let places = layout.places();
        for h in &mut held {
            if let Holding::Shard { params, group } = h {
                *group = places[params.start].group;
            }
        }
        ModuleView {
            layout,
            ids,
            held,
            trains: spec_trains,
        }
    }

    /// By flat group, whether any of its parameters trains now: a group that does not is
    /// neither reduced nor stepped.
    pub(super) fn group_trains(&self) -> Vec<bool> {
        self.layout
            .groups
            .iter()
            .map(|g| g.params.iter().any(|&p| self.trains.get(p).copied().unwrap_or(true)))
            .collect()
    }

    /// With `offload_param` on NVMe, every cut unit's shard must be in a store: the cut does it
    /// (`UnitPlan::offload_param`, which `initialize` sets); a unit cut without it would keep
    /// its shard on the device while the settings say otherwise.
    pub(super) fn check_offloaded(&self, settings: &EngineSettings) -> Result<(), ZeroError> {
        if !matches!(settings.offload_param, crate::settings::ParamOffload::Nvme { .. }) {
            return Ok(());
        }
        for (id, held) in self.ids.iter().zip(&self.held) {
            if let Holding::Shard { params, .. } = held {
                if crate::sharded::store_of(*id).is_none() {
                    return Err(ZeroError::Config(format!(
                        "zero_optimization.offload_param: the unit holding `{}` was cut without it; cut the model's \
                         units with UnitPlan::offload_param set (zero_burn::initialize does)",
                        self.layout.params[params.start].name
                    )));
                }
            }
        }
        Ok(())
    }

    /// The flat groups that are sharded units.
    pub(super) fn unit_groups(&self) -> Vec<usize> {
        self.held
            .iter()
            .filter_map(|h| match h {
                Holding::Shard { group, .. } => Some(*group),
                _ => None,
            })
            .collect()
    }

    /// Whether the module holds a `ZeroModule` (sharded or whole).
    pub(super) fn has_units(&self) -> bool {
        self.held
            .iter()
            .any(|h| matches!(h, Holding::Whole(_) | Holding::Shard { .. }))
    }

    /// The values of every layout parameter that `module` holds whole, and by float parameter
    /// of the module, the shards it holds; the error of an offloaded shard that cannot be read.
    pub(super) fn read<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        module: &M,
    ) -> Result<(Vec<Vec<f32>>, Shards), ZeroError> {
        let mut values = vec![Vec::new(); self.layout.params.len()];
        let mut shards = HashMap::new();
        crate::params::try_read_values::<B, M>(module, |i, v| match &self.held[i] {
            Holding::Param(p) => values[*p] = v,
            Holding::Whole(params) => split_into(&mut values, &self.layout, params.clone(), &v),
            Holding::Shard { .. } => {
                shards.insert(i, v);
            }
            Holding::Nothing => {}
        })?;
        Ok((values, shards))
    }

    /// A sharded unit's shard of `len` elements is the owned slice of its group, or the module
    /// was cut for another number of ranks.
    pub(super) fn check_shard(&self, params: &Range<usize>, group: usize, len: usize) -> Result<(), ZeroError> {
        let owned = self.layout.owned_len(group);
        if len == owned {
            return Ok(());
        }
        Err(ZeroError::Model(format!(
            "the ZeroModule shard holding `{}` has {len} elements where {} ranks own {owned} each: it was sharded \
             for another number of ranks",
            self.layout.params[params.start].name, self.layout.world_size,
        )))
    }
}

impl ModuleView {
    /// Fails unless the module still has the parameters of `layout` (the one the state was
    /// built with), naming the first that changed.
    pub(super) fn check_unchanged(&self, layout: &PartitionLayout) -> Result<(), ZeroError> {
        if self.layout.params == layout.params {
            return Ok(());
        }
        if self.layout.params.len() != layout.params.len() {
            return Err(ZeroError::Model(format!(
                "the model had {} parameters at the first step but has {} now: parameters must stay the same for the \
                 optimizer's lifetime",
                layout.params.len(),
                self.layout.params.len()
            )));
        }
        let (was, now) = layout
            .params
            .iter()
            .zip(&self.layout.params)
            .find(|(was, now)| was != now)
            .unwrap_or_else(|| unreachable!("the lists differ"));
        Err(ZeroError::Model(format!(
            "parameter `{}` had shape {:?} at the first step but is `{}` of shape {:?} now: parameters must keep \
             their names and shapes for the optimizer's lifetime",
            was.name, was.shape, now.name, now.shape
        )))
    }
}

/// Cuts a unit's flat vector `flat` into its parameters `params` of `layout` (padding beyond
/// them ignored).
pub(super) fn split_into(values: &mut [Vec<f32>], layout: &PartitionLayout, params: Range<usize>, flat: &[f32]) {
    let mut start = 0;
    for p in params {
        let numel = layout.params[p].numel();
        values[p] = flat[start.min(flat.len())..(start + numel).min(flat.len())].to_vec();
        start += numel;
    }
}

pub(super) fn first_device<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M) -> Result<B::Device, ZeroError> {
    module
        .devices()
        .into_iter()
        .next()
        .ok_or_else(|| ZeroError::Model("the model has no parameters (no device found)".into()))
}

/// Takes every float parameter's gradient out of a `GradientsParams`, flattened, by id.
pub(super) fn collect_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
) -> HashMap<ParamId, FlatGrad<B>> {
    struct Collect<'a, B: AutodiffBackend> {
        grads: &'a mut GradientsParams,
        out: HashMap<ParamId, FlatGrad<B>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                let n = g.shape().num_elements();
                self.out.insert(param.id, g.reshape([n]));
            }
        }
    }
    let mut c = Collect::<B> {
        grads,
        out: Default::default(),
    };
    module.visit(&mut c);
    c.out
}

impl ModuleView {
    /// Counts what the module holds in `memory`: replicated parameters whole, each unit's shard
    /// (at stage 2 a view of the unit's kept whole vector), and the units' gathers, which are
    /// the autodiff graph's, out of sight: counted from the layout, as the ZeRO formulas do. At
    /// stage 2 every unit keeps its whole vector from one step to the next: parameters, as
    /// ZeRO-2 counts them. At stage 3, under a checkpointing strategy a unit is freed after its
    /// use (one whole at a time, with what is prefetched beside it); without (`keeps_gathered`),
    /// every unit stays until backward.
    pub(super) fn account(
        &self,
        memory: &MemoryTracker,
        settings: &EngineSettings,
        world: usize,
        keeps_gathered: bool,
        host_state: bool,
    ) {
        let dtype = settings.precision.dtype;
        let units = self.unit_groups();
        let layout = &self.layout;
        let stage2 = settings.stage == Stage::Zero2;
        // Shards that `offload_param` keeps off the device, by group.
        let mut offloaded = HashMap::new();
        for (id, held) in self.ids.iter().zip(&self.held) {
            if let (Holding::Shard { group, .. }, Some(store)) = (held, crate::sharded::store_of(*id)) {
                offloaded.insert(*group, store);
            }
        }
        let held: usize = (0..layout.groups.len())
            .filter(|g| !offloaded.contains_key(g))
            .map(|g| match (units.contains(&g), stage2) {
                (true, true) => 0,
                (true, false) => layout.owned_len(g),
                (false, _) => layout.groups[g].numel,
            })
            .sum();
        memory.add_parameters(held * dtype.size());
        if host_state {
            // The model's gradients stay on its device from backward to the step, which brings
            // them to the state's host buffers: a unit's shard (its backward reduce-scattered
            // it), every other parameter whole; none of a group that does not train.
            let trains = self.group_trains();
            let grads: usize = (0..layout.groups.len())
                .filter(|&g| trains[g])
                .map(|g| {
                    if units.contains(&g) {
                        layout.owned_len(g)
                    } else {
                        layout.groups[g].numel
                    }
                })
                .sum();
            memory.add_model_gradients(grads * dtype.size());
        }
        for store in offloaded.values() {
            if store.in_file() {
                memory.add_nvme_parameters(store.bytes());
            } else {
                memory.add_host_parameters(store.bytes());
            }
        }
        let gathers: Vec<usize> = units.iter().map(|&g| layout.groups[g].padded * dtype.size()).collect();
        let all: usize = gathers.iter().sum();
        if stage2 {
            memory.add_parameters(all);
        } else if keeps_gathered {
            memory.add_gathered(all);
        } else if settings.prefetch_budget() > 0 && world > 1 {
            let budget = settings.prefetch_budget().saturating_mul(dtype.size());
            // zero estimate's rule, in bytes.
            let units: Vec<u64> = gathers.iter().map(|&b| b as u64).collect();
            let most = zero_core::estimate::gathered_with_prefetch(&units, budget as u64);
            memory.add_gathered(usize::try_from(most).unwrap_or(usize::MAX));
        } else {
            memory.add_gathered(gathers.iter().copied().max().unwrap_or(0));
        }
    }
}
