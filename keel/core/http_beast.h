// Conversion from a parsed Boost.Beast request to keel::HttpRequest, shared by the blocking
// HttpServer and the gateway's coroutine server so both fill path/query/headers the same way.
#pragma once

#include <string>
#include <string_view>
#include <utility>

#include <boost/beast/core/string.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>

#include "keel/core/http_server.h"

namespace keel {

// The origin form ("/v1/models?x=1") of a request target. RFC 9112 §3.2.2: a server must accept
// the absolute form ("http://host:8080/v1/models?x=1") too, which proxies send; its scheme and
// authority are dropped (an empty path is "/"). Other targets are returned as sent.
std::string OriginForm(std::string_view target);

// The path with its percent-escapes decoded (RFC 3986 §2.1), so routes match what clients mean:
// SDKs escape '/' inside a path segment (models.retrieve("org/model") sends org%2Fmodel). A path
// with a broken escape, or one that decodes to a NUL byte, is returned as sent.
std::string DecodePath(std::string_view path);

// RFC 9112 §3.2: an HTTP/1.1 request without exactly one Host field is answered 400.
inline bool MissingHost(const boost::beast::http::request_header<>& header, std::string* message) {
  if (header.version() < 11) return false;
  const size_t hosts = header.count(boost::beast::http::field::host);
  if (hosts == 1) return false;
  *message = hosts == 0 ? "an HTTP/1.1 request needs a Host header" : "a request may carry only one Host header";
  return true;
}

// The most request bytes a connection buffers that the parser has not taken: the header block
// (header_limit) plus room for a chunk-size line or trailer, which Beast bounds by nothing.
inline size_t MaxBufferedBytes(size_t max_header_bytes) { return max_header_bytes + 64 * 1024; }

// Moves the body out of `msg`.
inline HttpRequest ToHttpRequest(boost::beast::http::request<boost::beast::http::string_body>& msg,
                                 std::string remote) {
  HttpRequest req;
  req.method = std::string(msg.method_string());
  req.target = OriginForm(std::string_view(msg.target().data(), msg.target().size()));
  const size_t q = req.target.find('?');
  req.path = DecodePath(std::string_view(req.target).substr(0, q));
  if (q != std::string::npos) req.query = req.target.substr(q + 1);
  req.version = msg.version();
  for (const auto& f : msg) req.headers.Add(std::string(f.name_string()), std::string(f.value()));
  req.body = std::move(msg.body());
  req.remote = std::move(remote);
  return req;
}

// RFC 9112 §6.3 on a request's Transfer-Encoding, once its header is parsed. Beast accepts any
// coding and, unless the last one is chunked, reads no body: the body would then be parsed as the
// next request on the connection (request smuggling). Returns 0 when the framing is sound, else
// the status to answer before closing: 400 when chunked is not the final coding (the length
// cannot be known), 501 for a coding besides chunked (e.g. "gzip, chunked": not implemented).
inline int TransferCodingError(const boost::beast::http::request_header<>& header, bool chunked,
                               std::string* message) {
  namespace http = boost::beast::http;
  const size_t fields = header.count(http::field::transfer_encoding);
  if (fields == 0) return 0;
  if (!chunked) {
    *message = "Transfer-Encoding must end in chunked";
    return 400;
  }
  const auto field = header[http::field::transfer_encoding];
  const std::string_view value(field.data(), field.size());
  const size_t b = value.find_first_not_of(" \t"), e = value.find_last_not_of(" \t");
  const std::string_view coding = b == std::string_view::npos ? std::string_view() : value.substr(b, e - b + 1);
  if (fields > 1 || !boost::beast::iequals(boost::beast::string_view(coding.data(), coding.size()), "chunked")) {
    *message = "only the chunked transfer coding is supported";
    return 501;
  }
  return 0;
}

// RFC 9110 §8.4 on a request's Content-Encoding: a server that cannot decode the body's coding
// answers 415 (an SDK's gzip-compressed JSON would otherwise fail as "malformed JSON" at a binary
// byte). Returns 0 for none or "identity", else 415.
inline int ContentCodingError(const boost::beast::http::request_header<>& header, std::string* message) {
  namespace http = boost::beast::http;
  if (header.count(http::field::content_encoding) == 0) return 0;
  const auto field = header[http::field::content_encoding];
  const std::string_view value(field.data(), field.size());
  const size_t b = value.find_first_not_of(" \t"), e = value.find_last_not_of(" \t");
  const std::string_view coding = b == std::string_view::npos ? std::string_view() : value.substr(b, e - b + 1);
  if (coding.empty() || boost::beast::iequals(boost::beast::string_view(coding.data(), coding.size()), "identity")) {
    return 0;
  }
  *message = "Content-Encoding " + std::string(coding.substr(0, 64)) + " is not supported: send the body uncompressed";
  return 415;
}

}  // namespace keel
