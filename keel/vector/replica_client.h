// The router's names for keel/core/http_client.h, which holds the client since HiLO services need
// it too (keel_hilo must not depend on keel_vector). New code should use the keel:: names.
#pragma once

#include "keel/core/http_client.h"

namespace keel::vector {

using HttpEndpoint = keel::HttpEndpoint;
using HttpReply = keel::HttpReply;
using ReplicaClientOptions = keel::HttpClientOptions;
using ReplicaClient = keel::HttpClient;
using CallPool = keel::CallPool;
using keel::ParseHttpUrl;

}  // namespace keel::vector
