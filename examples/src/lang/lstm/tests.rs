//! The fused LSTM against the textbook formulas in candle's own operations.

use super::kernels::exp;
use super::*;
use candle_core::{Device, Var};

#[test]
fn fast_exp_is_close_to_libm() {
    for i in -2000..2000 {
        let x = i as f32 * 0.04;
        let (a, b) = (exp(x), x.exp());
        assert!(((a - b) / b).abs() < 5e-7, "exp({x}) = {a}, libm {b}");
    }
}

/// The fused sequence against the textbook formulas in candle's own operations: outputs
/// and the gradients of both inputs.
#[test]
fn lstm_matches_the_unfused_formulas() {
    let dev = Device::Cpu;
    let (t, b, h) = (4, 3, 5);
    let xp = Var::from_tensor(&Tensor::randn(0f32, 1.0, (t, b, 4 * h), &dev).unwrap()).unwrap();
    let w = Var::from_tensor(&Tensor::randn(0f32, 0.5, (4 * h, h), &dev).unwrap()).unwrap();
    let bias = Var::from_tensor(&Tensor::randn(0f32, 0.5, 4 * h, &dev).unwrap()).unwrap();
    let weights = Tensor::randn(0f32, 1.0, (t, b, h), &dev).unwrap();
    let cweights = Tensor::randn(0f32, 1.0, (b, h), &dev).unwrap();

    let fused = lstm(xp.as_tensor(), w.as_tensor(), bias.as_tensor()).unwrap();
    let f_h = fused.narrow(1, 0, 1).unwrap().squeeze(1).unwrap();
    let f_c = fused.get(t - 1).unwrap().get(1).unwrap();

    let (mut hs, mut hprev, mut cprev) = (
        vec![],
        Tensor::zeros((b, h), candle_core::DType::F32, &dev).unwrap(),
        Tensor::zeros((b, h), candle_core::DType::F32, &dev).unwrap(),
    );
    for s in 0..t {
        let p = (xp.as_tensor().get(s).unwrap()
            + hprev.matmul(&w.as_tensor().t().unwrap()).unwrap())
        .unwrap()
        .broadcast_add(bias.as_tensor())
        .unwrap();
        let sg = candle_nn::ops::sigmoid(&p).unwrap();
        let i = sg.narrow(1, 0, h).unwrap();
        let f = sg.narrow(1, h, h).unwrap();
        let g = p.narrow(1, 2 * h, h).unwrap().tanh().unwrap();
        let o = sg.narrow(1, 3 * h, h).unwrap();
        let c = ((f * &cprev).unwrap() + (i * g).unwrap()).unwrap();
        let hh = (o * c.tanh().unwrap()).unwrap();
        hs.push(hh.clone());
        hprev = hh;
        cprev = c;
    }
    let r_h = Tensor::stack(&hs, 0).unwrap();
    let diff = |a: &Tensor, b: &Tensor| {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    assert!(diff(&f_h, &r_h) < 1e-5);
    assert!(diff(&f_c, &cprev) < 1e-5);
    let objective = |hs: &Tensor, c: &Tensor| {
        ((hs * &weights).unwrap().sum_all().unwrap() + (c * &cweights).unwrap().sum_all().unwrap())
            .unwrap()
    };
    let gf = objective(&f_h, &f_c).backward().unwrap();
    let gr = objective(&r_h, &cprev).backward().unwrap();
    for v in [xp.as_tensor(), w.as_tensor(), bias.as_tensor()] {
        let (a, b) = (gf.get(v).unwrap(), gr.get(v).unwrap());
        assert!(diff(a, b) < 1e-5, "gradient differs by {}", diff(a, b));
    }
}

/// The last-step form is the whole sequence's hidden states read at each row's last step
/// through candle's operations (a one-hot mask, as the model read them before): the same
/// values and the same gradients.
#[test]
fn lstm_last_reads_the_states_at_each_rows_last_step() {
    let dev = Device::Cpu;
    let (t, b, h) = (5, 4, 3);
    let xp = Var::from_tensor(&Tensor::randn(0f32, 1.0, (t, b, 4 * h), &dev).unwrap()).unwrap();
    let w = Var::from_tensor(&Tensor::randn(0f32, 0.5, (4 * h, h), &dev).unwrap()).unwrap();
    let bias = Var::from_tensor(&Tensor::randn(0f32, 0.5, 4 * h, &dev).unwrap()).unwrap();
    let weights = Tensor::randn(0f32, 1.0, (b, h), &dev).unwrap();
    let last = Arc::new(vec![4u32, 0, 2, 2]);
    let mut mask = vec![0f32; t * b];
    for (r, &s) in last.iter().enumerate() {
        mask[s as usize * b + r] = 1.0;
    }
    let mask = Tensor::from_vec(mask, (t, b, 1), &dev).unwrap();
    let (x, wt, bt) = (xp.as_tensor(), w.as_tensor(), bias.as_tensor());
    let fast = lstm_last(x, wt, bt, Arc::clone(&last)).unwrap();
    let slow = lstm(x, wt, bt)
        .unwrap()
        .narrow(1, 0, 1)
        .unwrap()
        .squeeze(1)
        .unwrap()
        .broadcast_mul(&mask)
        .unwrap()
        .sum(0)
        .unwrap();
    let values = |x: &Tensor| x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(values(&fast), values(&slow));
    let grads = |y: &Tensor| {
        (y * &weights)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap()
    };
    let (gf, gs) = (grads(&fast), grads(&slow));
    for v in [x, wt, bt] {
        let (a, b) = (values(gf.get(v).unwrap()), values(gs.get(v).unwrap()));
        let worst = a
            .iter()
            .zip(&b)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-6, "gradient differs by {worst}");
        assert!(a.iter().any(|g| *g != 0.0));
    }
    assert!(lstm_last(x, wt, bt, Arc::new(vec![5, 0, 0, 0])).is_err());
}
