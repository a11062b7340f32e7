//! Enrollment administration through the client API: join tokens (`toolctl token create`).

use std::collections::BTreeMap;
use std::time::Duration;

use tonic::{Request, Response, Status};
use toolsrv_proto::v1::join_tokens_client::JoinTokensClient;
use toolsrv_proto::v1::join_tokens_server::{JoinTokens, JoinTokensServer};
use toolsrv_proto::v1::{CreateJoinTokenRequest, CreateJoinTokenResponse};

use crate::{Client, ClientError};

impl Client {
    /// Creates a one-time join token for `host_id`, usable for `ttl` (`None`: the coordinator's
    /// default, one hour), binding `labels` to the host's certificate. Only clients matching the
    /// coordinator's `--admin` may; others get PERMISSION_DENIED.
    pub async fn create_join_token(
        &self,
        host_id: &str,
        ttl: Option<Duration>,
        labels: BTreeMap<String, String>,
    ) -> Result<CreateJoinTokenResponse, ClientError> {
        let request = CreateJoinTokenRequest {
            host_id: host_id.to_string(),
            ttl_seconds: ttl.map_or(0, |t| t.as_secs().max(1)),
            labels,
        };
        let response = JoinTokensClient::new(self.channel.clone())
            .create_join_token(request)
            .await?;
        Ok(response.into_inner())
    }
}

/// `JoinTokens` passed on unchanged over a `toolctl master`'s connection (see
/// [`crate::control`]), as the `Tools` RPCs are.
pub(crate) fn relay(upstream: tonic::transport::Channel) -> JoinTokensServer<TokenRelay> {
    JoinTokensServer::new(TokenRelay {
        upstream: JoinTokensClient::new(upstream),
    })
}

#[derive(Debug)]
pub(crate) struct TokenRelay {
    upstream: JoinTokensClient<tonic::transport::Channel>,
}

#[tonic::async_trait]
impl JoinTokens for TokenRelay {
    async fn create_join_token(
        &self,
        req: Request<CreateJoinTokenRequest>,
    ) -> Result<Response<CreateJoinTokenResponse>, Status> {
        self.upstream
            .clone()
            .create_join_token(req.into_inner())
            .await
    }
}
