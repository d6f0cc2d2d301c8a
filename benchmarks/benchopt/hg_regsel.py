"""A regularization-selection problem of ijcnn1's shape that runs offline (a benchopt dataset of
benchmark_bilevel, installed into a checkout's ``datasets/`` by ``python -m benchmarks benchopt``).

ijcnn1 (49,990 training and 91,701 test samples, 22 features, labels ±1) is downloaded by the
benchmark; this draws data of the same shape with scikit-learn's ``make_classification`` and
poses the same problem: binary logistic regression with one penalty ``e^{x_j}`` per feature,

    G(z, x) = mean_i log(1 + exp(-y_i <a_i, z>)) + 1/2 sum_j e^{x_j} z_j^2,
    F(z, x) = the same data term on the validation samples,

with the same metrics: ``value_func`` = F(z*(x), x) at an L-BFGS inner solution (jaxopt, the
reference the benchmark's ijcnn1 uses), ``value`` = the squared norm of its gradient by
implicit differentiation, ``inner_distance`` = |z - z*(x)|^2.
"""

from benchopt import BaseDataset, safe_import_context

with safe_import_context() as import_ctx:
    from functools import partial

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jaxopt import LBFGS
    from sklearn.datasets import make_classification
    from sklearn.preprocessing import StandardScaler


def _data_term(z, a, y):
    return jnp.mean(jax.nn.softplus(-y * (a @ z)))


class Dataset(BaseDataset):
    name = "hg_regsel"
    requirements = ["scikit-learn", "pip:jaxopt"]
    parameters = {
        "n_train": [49_990],
        "n_val": [91_701],
        "n_features": [22],
        "random_state": [0],
    }

    def get_data(self):
        a, y = make_classification(
            n_samples=self.n_train + self.n_val, n_features=self.n_features,
            n_informative=6, n_redundant=4, flip_y=0.05, class_sep=0.8,
            random_state=self.random_state,
        )
        scaler = StandardScaler().fit(a[: self.n_train])
        a = scaler.transform(a).astype(np.float32)
        y = (2.0 * y - 1.0).astype(np.float32)
        X_train, y_train = jnp.asarray(a[: self.n_train]), jnp.asarray(y[: self.n_train])
        X_val, y_val = jnp.asarray(a[self.n_train:]), jnp.asarray(y[self.n_train:])
        hg_regsel = True  # the marker hypergrad's torch solvers recognise the problem by
        d = self.n_features

        @partial(jax.jit, static_argnames=("batch_size",))
        def f_inner(inner_var, outer_var, start=0, batch_size=1):
            assert hg_regsel
            a_b = jax.lax.dynamic_slice(X_train, (start, 0), (batch_size, d))
            y_b = jax.lax.dynamic_slice(y_train, (start,), (batch_size,))
            penalty = 0.5 * jnp.sum(jnp.exp(outer_var) * inner_var**2)
            return _data_term(inner_var, a_b, y_b) + penalty

        @partial(jax.jit, static_argnames=("batch_size",))
        def f_outer(inner_var, outer_var, start=0, batch_size=1):
            a_b = jax.lax.dynamic_slice(X_val, (start, 0), (batch_size, d))
            y_b = jax.lax.dynamic_slice(y_val, (start,), (batch_size,))
            return _data_term(inner_var, a_b, y_b)

        f_inner_fb = partial(f_inner, start=0, batch_size=self.n_train)
        f_outer_fb = partial(f_outer, start=0, batch_size=self.n_val)
        inner_solver = LBFGS(fun=f_inner_fb, tol=1e-6, maxiter=500)

        def value(outer_var):
            z_star = inner_solver.run(jnp.zeros(d), outer_var).params
            return f_outer_fb(z_star, outer_var), z_star

        value_and_grad = jax.jit(jax.value_and_grad(value, has_aux=True))

        def metrics(inner_var, outer_var):
            (h, z_star), g = value_and_grad(outer_var)
            return dict(
                value_func=float(h),
                value=float(jnp.sum(g**2)),
                inner_distance=float(jnp.sum((z_star - inner_var) ** 2)),
            )

        def init_var(key):
            k1, k2 = jax.random.split(key)
            return (jax.random.normal(k1, (d,)),
                    jnp.log(jax.random.uniform(k2, (d,))))

        return dict(
            pb_inner=(f_inner, self.n_train, d, f_inner_fb),
            pb_outer=(f_outer, self.n_val, d, f_outer_fb),
            metrics=metrics,
            init_var=init_var,
        )
