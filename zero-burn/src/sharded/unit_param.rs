//! The parameter a [`ZeroModule`](super::ZeroModule) holds its flat vector (or shard) in: a Burn
//! `Param` in every respect but one. Loading a Burn record into it keeps the parameter's own id
//! (a `Param` takes the record's): the id is how the unit is found (the unit registry, the
//! optimizer, the cut), so a record loaded into a wrapped model, by one rank or by every rank
//! thread from the same file, leaves each unit answering to its own id. Its record is a
//! `Param`'s: records written before and after read the same.

use burn::module::{
    AutodiffModule, Content, HasAutodiffModule, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper,
    ModuleVisitor, Param,
};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;

/// A unit's flat parameter (see the module docs).
#[derive(Clone, Debug)]
pub(super) struct UnitParam<B: Backend>(pub(super) Param<Tensor<B, 1>>);

impl<B: Backend> std::ops::Deref for UnitParam<B> {
    type Target = Param<Tensor<B, 1>>;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl<B: Backend> Module<B> for UnitParam<B> {
    type Record = <Param<Tensor<B, 1>> as Module<B>>::Record;

    fn collect_devices(&self, devices: Vec<B::Device>) -> Vec<B::Device> {
        Module::collect_devices(&self.0, devices)
    }

    fn fork(self, device: &B::Device) -> Self {
        UnitParam(Module::fork(self.0, device))
    }

    fn to_device(self, device: &B::Device) -> Self {
        UnitParam(Module::to_device(self.0, device))
    }

    fn visit<V: ModuleVisitor<B>>(&self, visitor: &mut V) {
        Module::visit(&self.0, visitor)
    }

    fn map<M: ModuleMapper<B>>(self, mapper: &mut M) -> Self {
        UnitParam(Module::map(self.0, mapper))
    }

    /// The record's values under this parameter's id (its device, autodiff setting and load
    /// mapper kept, as a `Param`'s load keeps them).
    fn load_record(self, record: Self::Record) -> Self {
        let id = self.0.id;
        let (_, values, _) = record.consume();
        UnitParam(self.0.transform_for_load(values, id))
    }

    fn into_record(self) -> Self::Record {
        Module::into_record(self.0)
    }
}

impl<B: AutodiffBackend> AutodiffModule<B> for UnitParam<B> {
    type InnerModule = UnitParam<B::InnerBackend>;

    fn valid(&self) -> Self::InnerModule {
        UnitParam(AutodiffModule::valid(&self.0))
    }

    fn from_inner(module: Self::InnerModule) -> Self {
        UnitParam(Param::from_inner(module.0))
    }
}

impl<B: AutodiffBackend> HasAutodiffModule<B> for UnitParam<B::InnerBackend> {
    type TrainModule = UnitParam<B>;
}

impl<B: Backend> ModuleDisplayDefault for UnitParam<B> {
    fn content(&self, content: Content) -> Option<Content> {
        ModuleDisplayDefault::content(&self.0, content)
    }

    fn num_params(&self) -> usize {
        ModuleDisplayDefault::num_params(&self.0)
    }
}

impl<B: Backend> ModuleDisplay for UnitParam<B> {}
