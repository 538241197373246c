use candle_core::{DType, Device, Tensor, Var};

use super::{backward, matmul};

fn var(shape: (usize, usize), seed: u64) -> Var {
    let n = shape.0 * shape.1;
    let v: Vec<f32> = (0..n as u64)
        .map(|i| ((i * 2_654_435_761 + seed * 97) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu).unwrap()).unwrap()
}

fn input(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 101) as f32 / 50.0 - 1.0)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

/// A two-layer MLP on a 3-dimensional input (leading dimensions flattened); `mm` is the
/// product used for each layer.
fn mlp(w: &[Var], x: &Tensor, mm: impl Fn(&Tensor, &Tensor) -> Tensor) -> Tensor {
    let h = mm(x, w[0].as_tensor()).relu().unwrap();
    mm(&h, w[1].as_tensor()).sqr().unwrap().mean_all().unwrap()
}

/// ONCE-1: forward and every gradient are candle's, bit for bit, for parameters used once.
#[test]
fn gradients_are_candle_s_bit_for_bit() {
    let w = [var((8, 16), 1), var((16, 4), 2)];
    let x = input(&[3, 5, 8]);
    let plain = mlp(&w, &x, |a, b| a.broadcast_matmul(b).unwrap());
    let once = mlp(&w, &x, |a, b| matmul(a, b).unwrap());
    assert_eq!(values(&plain), values(&once));
    let g_plain = plain.backward().unwrap();
    let g_once = backward(&once).unwrap();
    for v in &w {
        let (a, b) = (g_plain.get(v.as_tensor()), g_once.get(v.as_tensor()));
        assert_eq!(
            values(a.unwrap()),
            values(b.expect("a gradient for every parameter"))
        );
    }
}

/// ONCE-1: a parameter used twice through `matmul` and once by another operation gets the
/// sum of the three parts.
#[test]
fn a_parameter_used_several_times_gets_the_sum() {
    let w = var((6, 6), 3);
    let x = input(&[4, 6]);
    let loss = |mm: &dyn Fn(&Tensor, &Tensor) -> Tensor| {
        let h = mm(&mm(&x, w.as_tensor()).tanh().unwrap(), w.as_tensor());
        (h.sqr().unwrap().sum_all().unwrap() + w.as_tensor().sqr().unwrap().sum_all().unwrap())
            .unwrap()
    };
    let plain = loss(&|a, b| a.matmul(b).unwrap()).backward().unwrap();
    let once = backward(&loss(&|a, b| matmul(a, b).unwrap())).unwrap();
    let (a, b) = (
        values(plain.get(w.as_tensor()).unwrap()),
        values(once.get(w.as_tensor()).unwrap()),
    );
    for (p, q) in a.iter().zip(&b) {
        assert!((p - q).abs() <= 1e-5 * p.abs().max(1.0), "{p} against {q}");
    }
}

/// ONCE-2: through a plain `backward()`, and for a weight that is not a variable itself (a
/// transposed view of one), the gradients still reach the variables.
#[test]
fn without_opting_in_gradients_take_candle_s_path() {
    let w = var((5, 3), 4);
    let x = input(&[2, 5]);
    let once = matmul(&x, w.as_tensor()).unwrap().sum_all().unwrap();
    let reference = x.matmul(w.as_tensor()).unwrap().sum_all().unwrap();
    let (g, r) = (once.backward().unwrap(), reference.backward().unwrap());
    assert_eq!(
        values(g.get(w.as_tensor()).unwrap()),
        values(r.get(w.as_tensor()).unwrap())
    );

    let wt = var((3, 5), 5);
    let view = wt.as_tensor().t().unwrap();
    let loss = matmul(&x, &view).unwrap().sqr().unwrap().sum_all().unwrap();
    let g = backward(&loss).unwrap();
    let r = x
        .matmul(&view)
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(
        values(g.get(wt.as_tensor()).unwrap()),
        values(r.get(wt.as_tensor()).unwrap())
    );
}

/// A backward pass that panics half way leaves this thread as it was: the next plain
/// `backward()` still finds every gradient (before the guard, gradients went on being
/// taken for a collection nobody read, and that backward silently lacked them).
#[test]
fn a_panic_in_backward_does_not_leave_gradients_taken() {
    struct Boom;
    impl candle_core::CustomOp1 for Boom {
        fn name(&self) -> &'static str {
            "boom"
        }
        fn cpu_fwd(
            &self,
            s: &candle_core::CpuStorage,
            l: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            let Some((a, b)) = l.contiguous_offsets() else {
                candle_core::bail!("boom: not contiguous")
            };
            let candle_core::CpuStorage::F32(v) = s else {
                candle_core::bail!("boom: f32 only")
            };
            Ok((
                candle_core::CpuStorage::F32(v[a..b].to_vec()),
                l.shape().clone(),
            ))
        }
        fn bwd(&self, _: &Tensor, _: &Tensor, _: &Tensor) -> candle_core::Result<Option<Tensor>> {
            panic!("boom in backward")
        }
    }
    let w = var((4, 4), 6);
    let x = input(&[2, 4]);
    // `boom` sits between the loss and the product, so the panic comes after nothing was
    // taken yet; a second product after it is backpropagated first and taken.
    let h = matmul(&x, w.as_tensor()).unwrap().apply_op1(Boom).unwrap();
    let loss = matmul(&h, w.as_tensor()).unwrap().sum_all().unwrap();
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| backward(&loss)));
    assert!(caught.is_err(), "the op panicked");
    let again = matmul(&x, w.as_tensor()).unwrap().sum_all().unwrap();
    let g = again.backward().unwrap();
    assert!(
        g.get(w.as_tensor()).is_some(),
        "the gradient was taken and lost"
    );
    assert_eq!(g.get(w.as_tensor()).unwrap().dtype(), DType::F32);
}

/// Operands candle's `matmul` refuses are refused the same way, and a transposed input (a
/// strided view) gives candle's product.
#[test]
fn odd_operands_behave_as_candle_s_matmul() {
    let w = var((4, 3), 7);
    let x64 = input(&[2, 4]).to_dtype(DType::F64).unwrap();
    let ours = matmul(&x64, w.as_tensor())
        .map(|_| ())
        .unwrap_err()
        .to_string();
    let theirs = x64
        .matmul(w.as_tensor())
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        ours.contains("dtype") && theirs.contains("dtype"),
        "{ours} / {theirs}"
    );
    let xt = input(&[4, 2]).t().unwrap();
    assert_eq!(
        values(&matmul(&xt, w.as_tensor()).unwrap()),
        values(&xt.matmul(w.as_tensor()).unwrap())
    );
    let err = matmul(&input(&[2, 5]), w.as_tensor())
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(err.contains("(4, 3)"), "{err}");
}

/// An identity op that notes in `log` when its backward runs.
struct Noted(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl candle_core::CustomOp1 for Noted {
    fn name(&self) -> &'static str {
        "noted"
    }
    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (Some((a, b)), candle_core::CpuStorage::F32(v)) = (l.contiguous_offsets(), s) else {
            candle_core::bail!("noted: contiguous f32 only")
        };
        Ok((
            candle_core::CpuStorage::F32(v[a..b].to_vec()),
            l.shape().clone(),
        ))
    }
    fn bwd(&self, _: &Tensor, _: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        self.0.lock().unwrap().push("upstream".into());
        Ok(Some(g.clone()))
    }
}

/// `backward_observed` hands each weight's product over before backward goes on below the
/// layer: the op that feeds the product is backpropagated after `ready` ran. A weight used
/// once ends in the store as the very tensor handed over; one used twice is handed over
/// twice, and the store holds the sum.
#[test]
fn ready_sees_each_weight_product_before_backward_goes_below_it() {
    use std::sync::{Arc, Mutex};
    let log = Arc::new(Mutex::new(Vec::new()));
    let (w, u) = (var((4, 4), 8), var((4, 3), 9));
    let x = Var::from_tensor(&input(&[2, 4])).unwrap();
    let below = x.as_tensor().apply_op1(Noted(Arc::clone(&log))).unwrap();
    let h = matmul(&below, w.as_tensor()).unwrap().tanh().unwrap();
    let h = matmul(&h, w.as_tensor()).unwrap(); // w twice
    let loss = matmul(&h, u.as_tensor())
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (l, s) = (Arc::clone(&log), Arc::clone(&seen));
    let ids = (w.as_tensor().id(), u.as_tensor().id());
    let grads = super::backward_observed(&loss, move |p, dw| {
        let name = if p.id() == ids.0 { "w" } else { "u" };
        l.lock().unwrap().push(name.to_string());
        s.lock().unwrap().push((p.id(), dw.clone()));
    })
    .unwrap();
    assert_eq!(*log.lock().unwrap(), ["u", "w", "w", "upstream"]);
    let seen = seen.lock().unwrap();
    let g_u = grads.get(u.as_tensor()).unwrap();
    assert_eq!(
        seen[0].1.id(),
        g_u.id(),
        "u's gradient is the product handed over"
    );
    let sum = (&seen[1].1 + &seen[2].1).unwrap();
    assert_eq!(values(grads.get(w.as_tensor()).unwrap()), values(&sum));
    // The same gradients as the plain collection.
    let again = backward(&loss).unwrap();
    assert_eq!(values(again.get(w.as_tensor()).unwrap()), values(&sum));
}
