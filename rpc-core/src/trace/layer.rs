//! Spans of the `tracing` ecosystem recorded into a worker's trace: a program that already
//! writes `tracing::info_span!("forward")` gets those spans in the job's trace by adding this
//! layer to its subscriber. Each span is recorded from its creation to its close, as a
//! [`Cat::Compute`] span named by the span's name.

use tracing::span::{Attributes, Id};
use tracing::Subscriber;
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;

use super::{clock, Cat, Record, Tracer};

/// A `tracing_subscriber` layer that records every span it sees into `tracer`'s ring (filter
/// it with `Layer::with_filter` like any layer). Does nothing when the tracer is off.
///
/// ```
/// use tracing_subscriber::layer::SubscriberExt;
/// # fn demo(agent: &rpc_core::Agent) {
/// let subscriber = tracing_subscriber::registry()
///     .with(rpc_core::trace::TraceLayer::new(agent.tracer()));
/// tracing::subscriber::with_default(subscriber, || {
///     let _s = tracing::info_span!("forward").entered();
/// });
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct TraceLayer {
    tracer: Tracer,
}

impl TraceLayer {
    /// A layer recording into `tracer`.
    pub fn new(tracer: Tracer) -> Self {
        Self { tracer }
    }
}

/// When a span was created, kept in its extensions.
struct Started(u64);

impl<S> tracing_subscriber::Layer<S> for TraceLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, _attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if !self.tracer.is_on() {
            return;
        }
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(Started(clock::ticks()));
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let Some(ring) = self.tracer.ring() else {
            return;
        };
        let Some(span) = ctx.span(&id) else {
            return;
        };
        let Some(&Started(start)) = span.extensions().get::<Started>() else {
            return;
        };
        let mut rec = Record::new(Cat::Compute, span.name().into(), start);
        rec.end();
        rec.set_detail(span.metadata().target().to_owned());
        ring.push(rec);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    /// A `tracing` span lands in the ring as a compute span of its name; off, nothing does.
    #[test]
    fn tracing_spans_are_recorded() {
        let tracer = Tracer::on("unused".into(), 16);
        let subscriber = tracing_subscriber::registry().with(TraceLayer::new(tracer.clone()));
        tracing::subscriber::with_default(subscriber, || {
            let _s = tracing::info_span!("forward").entered();
        });
        let (events, _) = tracer.ring().unwrap().snapshot();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].name, "forward");
        assert_eq!(events[0].cat, Cat::Compute);
        let off = Tracer::off();
        let subscriber = tracing_subscriber::registry().with(TraceLayer::new(off.clone()));
        tracing::subscriber::with_default(subscriber, || {
            let _s = tracing::info_span!("forward").entered();
        });
        assert_eq!(off.counts(), (0, 0));
    }
}
