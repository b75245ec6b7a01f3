//! A bound on requests being read at once, across all connections. tonic buffers a whole
//! request (up to the message limit) before the handler's admission queue sees it, so without
//! this, N streams could each hold a request's worth of memory however full the queue is.

use std::convert::Infallible;
use std::sync::Arc;

use tokio::sync::Semaphore;
use tonic::body::Body;
use tonic::codegen::http::{Request, Response};
use tonic::codegen::{BoxFuture, Context, Poll, Service};
use tonic::server::NamedService;

use crate::metrics::LoaderMetrics;

/// Wraps the gRPC service: a request beyond `limit` in flight is answered RESOURCE_EXHAUSTED
/// at once, before its body is read.
#[derive(Clone)]
pub struct RequestGate<S> {
    inner: S,
    permits: Arc<Semaphore>,
    limit: usize,
    metrics: Arc<LoaderMetrics>,
}

impl<S> RequestGate<S> {
    pub fn new(inner: S, limit: usize, metrics: Arc<LoaderMetrics>) -> Self {
        Self {
            inner,
            permits: Arc::new(Semaphore::new(limit.max(1))),
            limit: limit.max(1),
            metrics,
        }
    }
}

impl<S: NamedService> NamedService for RequestGate<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<Request<Body>> for RequestGate<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let Ok(permit) = self.permits.clone().try_acquire_owned() else {
            self.metrics.reject("requests_in_flight");
            let status = tonic::Status::resource_exhausted(format!(
                "{} requests already in flight on this decoder; retry later",
                self.limit
            ));
            return Box::pin(async move { Ok(status.into_http()) });
        };
        let call = self.inner.call(request);
        Box::pin(async move {
            let response = call.await;
            drop(permit);
            response
        })
    }
}
