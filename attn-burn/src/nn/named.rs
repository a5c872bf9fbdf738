//! Every float parameter of a module by its PyTorch path (`q_proj.weight`,
//! `layers.0.norm1.bias`), found by burn's `ModuleVisitor`, with its values or its
//! gradient as f32: the names a PyTorch `state_dict` and `attn-multihead` use.

use attn_core::{AttnError, Result};
use burn::module::{Module, ModuleVisitor, Param};
use burn_tensor::{Gradients, Tensor};

/// What the walk reads of each parameter.
enum Read<'a> {
    Value,
    Grad(&'a Gradients),
}

struct Walk<'a> {
    path: Vec<String>,
    read: Read<'a>,
    out: Vec<(String, Vec<f32>)>,
    error: Option<AttnError>,
}

fn f32_values<const N: usize>(t: Tensor<N>) -> Result<Vec<f32>> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().map_err(|e| AttnError::backend("burn", format!("{e:?}")))
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
            Read::Value => f32_values(t),
            Read::Grad(g) => t.grad(g).map(f32_values).unwrap_or(Ok(Vec::new())),
        };
        match v {
            Ok(v) => self.out.push((self.path.join("."), v)),
            Err(e) => {
                self.error.get_or_insert(e);
            }
        }
    }
}

fn walk(module: &impl Module, read: Read<'_>) -> Result<Vec<(String, Vec<f32>)>> {
    let mut w = Walk { path: Vec::new(), read, out: Vec::new(), error: None };
    module.visit(&mut w);
    match w.error {
        Some(e) => Err(e),
        None => Ok(w.out),
    }
}

/// Every parameter's path and values.
pub fn param_values(module: &impl Module) -> Result<Vec<(String, Vec<f32>)>> {
    walk(module, Read::Value)
}

/// Every parameter's path and its gradient in `grads` (empty where none reached it).
pub fn param_grads(module: &impl Module, grads: &Gradients) -> Result<Vec<(String, Vec<f32>)>> {
    walk(module, Read::Grad(grads))
}
