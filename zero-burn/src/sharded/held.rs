//! What each float parameter of a model holding `ZeroModule`s is, as an optimizer sees it.

use super::module::{shard_len, unit, wrong_length};
use crate::error::ZeroError;
use burn::module::{Module, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use zero_core::partition::ParamSpec;

/// How an optimizer sees one float parameter of a model holding [`ZeroModule`](super::ZeroModule)s.
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

/// Whether every `ZeroModule` of `module` is one `initialize` can take: its flat parameter is
/// one this process knows as a unit's (a module mapper that gave it a new one leaves a unit
/// that could be neither cut nor gathered as one; a loaded Burn record keeps the unit's id), and
/// it holds what its unit can hold (a Burn record of another cut loaded into it does not).
pub(crate) fn check_units<B: Backend, M: Module<B>>(module: &M) -> Result<(), ZeroError> {
    struct Find {
        path: Vec<String>,
        in_shard: bool,
        unknown: Vec<String>,
        misfit: Option<ZeroError>,
    }
    impl<B: Backend> burn::module::ModuleVisitor<B> for Find {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            self.in_shard = container_type == "Struct:ZeroModule" && name == "shard";
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
            self.in_shard = false;
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if !self.in_shard {
                return;
            }
            let unit_path = self.path[..self.path.len().saturating_sub(1)].join(".");
            let Some(unit) = unit(param.id) else {
                self.unknown.push(unit_path);
                return;
            };
            let held = param.lazy_shape().num_elements();
            if !unit.holds(held) && self.misfit.is_none() {
                let world = unit.sharding.get().map(|s| s.world);
                // Emptied by the skeleton of a unit it sits in.
                self.misfit = Some(if held == 0 {
                    super::cut::nested_unit()
                } else {
                    wrong_length(&format!("the ZeroModule at {unit_path}"), held, unit.numel, world)
                });
            }
        }
    }
    let mut find = Find {
        path: Vec::new(),
        in_shard: false,
        unknown: Vec::new(),
        misfit: None,
    };
    module.visit(&mut find);
    if !find.unknown.is_empty() {
        return Err(ZeroError::Usage(format!(
            "the ZeroModules at {} hold parameters no unit of this process was made with (a module mapper that \
             replaced their flat parameter with a new one), so they could be neither cut nor gathered as units: \
             change a unit's values with ZeroModule::modify, or map the module before wrapping it",
            find.unknown.join(", ")
        )));
    }
    find.misfit.map_or(Ok(()), Err)
}

/// Whether `module` holds a [`ZeroModule`](super::ZeroModule) anywhere inside it.
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
