//! Every float parameter of a burn module by its path (`self_attn.q_proj.weight`,
//! `layers.0.norm1.bias`), found by burn's `ModuleVisitor`, with its value or gradient.

use burn::module::{Module, ModuleVisitor, Param};
use burn_tensor::Gradients;
use burn_tensor::Tensor;

use super::values;

/// What the walk reads of each parameter.
enum Read<'a> {
    Value,
    Grad(&'a Gradients),
}

struct Walk<'a> {
    path: Vec<String>,
    read: Read<'a>,
    out: Vec<(String, Vec<f32>)>,
}

impl ModuleVisitor for Walk<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let t = param.val();
        let v = match self.read {
            Read::Value => values(t),
            Read::Grad(g) => t.grad(g).map(values).unwrap_or_default(),
        };
        self.out.push((self.path.join("."), v));
    }
}

fn walk(module: &impl Module, read: Read<'_>) -> Vec<(String, Vec<f32>)> {
    let mut w = Walk { path: Vec::new(), read, out: Vec::new() };
    module.visit(&mut w);
    w.out
}

/// Every parameter's path and value.
pub fn param_values(module: &impl Module) -> Vec<(String, Vec<f32>)> {
    walk(module, Read::Value)
}

/// Every parameter's path and gradient (empty where none reached it).
pub fn param_grads(module: &impl Module, grads: &Gradients) -> Vec<(String, Vec<f32>)> {
    walk(module, Read::Grad(grads))
}
